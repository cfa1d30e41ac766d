"""The lock-free single-producer/single-consumer ring of the ``shm`` transport:
its memory layout and the Numba kernels that touch it.

Layout of one ring (one per ordered pair of ranks, in the receiver's region)
    A control block of four 128-byte lines, one word each, so that no two
    writers share a line (128, not 64: the adjacent-line prefetcher pairs lines):

    ======  ===================  =========================================
    word    written by           meaning
    ======  ===================  =========================================
    HEAD    producer             bytes published (monotonic)
    TAIL    consumer             bytes consumed (monotonic)
    ASLEEP  consumer             1: no thread of the consumer polls; poke it
    BLOCKED producer             1: a send waits for room; poke when freed
    ======  ===================  =========================================

    then ``capacity`` bytes of records (a power of two). A record is a
    32-byte header (``kind | stamp length << 8 | record bytes << 16``, tag,
    message bytes, chunk bytes), the stamp, the chunk, padded to 64 bytes. A
    record never wraps: when it does not fit before the end, the producer
    writes a ``PAD`` record up to the end and starts over at 0. ``RESERVE``
    bytes are always left free, so ``BYE`` fits even in a full ring.

Memory ordering
    The producer writes a record with plain stores and then publishes it
    with a *release* store of HEAD; the consumer reads HEAD with an *acquire*
    load before it reads the record, and frees the space with a release store
    of TAIL (after its copy out) that the producer reads with an acquire load
    before it overwrites. These are real LLVM atomic loads/stores (not
    ``volatile`` tricks or call boundaries), so neither the compiler nor the
    CPU may reorder around them: on x86-64 they are plain ``mov`` (TSO gives
    release/acquire for free, the atomic only pins the compiler); on AArch64
    LLVM emits ``stlr``/``ldar``. Copies done by NumPy or ``memcpy`` before a
    release store (or after an acquire load) in program order are covered.

    Going to sleep is a Dekker handshake (store my flag, then load the
    other's index), which release/acquire does not order (x86 may let the
    load pass the store): both sides put a sequentially consistent fence
    between the two (``lock or`` on x86, ``dmb ish`` on AArch64). Producer:
    ``HEAD = h (release); fence; if ASLEEP: poke``. Consumer:
    ``ASLEEP = 1; fence; if HEAD != TAIL: drain``. One side always sees the
    other, so no wake-up is lost. BLOCKED/TAIL mirror it for room.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "HEAD", "TAIL", "ASLEEP", "BLOCKED", "CTRL_WORDS", "CTRL_NBYTES", "HEADER_NBYTES",
    "RESERVE_NBYTES", "KIND_PAD", "KIND_FIRST", "KIND_MORE", "KIND_BYE",
    "ring_put", "ring_next", "ring_free", "ring_bye", "ring_set_flag", "rings_set_flag", "copy_bytes",
    "spin_ready", "ring_nbytes_for", "ring_index", "RingViews",
]

# Word indices (uint64) in a ring's control block.
HEAD, TAIL, ASLEEP, BLOCKED = 0, 16, 32, 48
CTRL_WORDS = 64
CTRL_NBYTES = CTRL_WORDS * 8
HEADER_NBYTES = 32
ALIGN = 64
#: Kept free so that BYE (a header alone) always fits.
RESERVE_NBYTES = ALIGN

KIND_PAD, KIND_FIRST, KIND_MORE, KIND_BYE = 1, 2, 3, 4



# --- atomics (numba has none on the CPU: emit LLVM's own) --------------------------


def _item_pointer(context, builder, aryty, ary_value, idx_value, idx_type):
    ary = context.make_array(aryty)(context, builder, ary_value)
    idx = context.cast(builder, idx_value, idx_type, types.intp)
    return cgutils.get_item_pointer(context, builder, aryty, ary, [idx])


@intrinsic
def _load_acquire(typingctx, arr, idx):
    sig = types.int64(arr, idx)

    def codegen(context, builder, sig, args):
        ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        # int64: indices and flags stay far below 2**63, and numba turns
        # mixed uint64/int64 arithmetic into float64.
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def _store_release(typingctx, arr, idx, val):
    sig = types.void(arr, idx, val)

    def codegen(context, builder, sig, args):
        ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        value = context.cast(builder, args[2], sig.args[2], types.uint64)
        builder.store_atomic(value, ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fence(typingctx):
    sig = types.void()

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _memcpy(typingctx, dst, dst_offset, src, src_offset, nbytes):
    """``memcpy`` between byte arrays (LLVM's intrinsic: libc's ``memcpy``)."""
    sig = types.void(dst, dst_offset, src, src_offset, nbytes)

    def codegen(context, builder, sig, args):
        def at(i):
            base = context.make_array(sig.args[i])(context, builder, args[i]).data
            return builder.gep(base, [context.cast(builder, args[i + 1], sig.args[i + 1], types.intp)])

        count = context.cast(builder, args[4], sig.args[4], types.intp)
        cgutils.raw_memcpy(builder, at(0), at(2), count, 1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _sched_yield(typingctx):
    sig = types.int32()

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        return builder.call(fn, [])

    return sig, codegen


@intrinsic
def _monotonic_ns(typingctx):
    """``clock_gettime(CLOCK_MONOTONIC)`` in ns: the clock of ``time.monotonic_ns``."""
    sig = types.int64()

    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        ts = cgutils.alloca_once(builder, ir.ArrayType(i64, 2))
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i32, [i32, ts.type]), "clock_gettime")
        builder.call(fn, [ir.Constant(i32, 1), ts])  # 1 = CLOCK_MONOTONIC on Linux
        zero = ir.Constant(i32, 0)
        sec = builder.load(builder.gep(ts, [zero, zero]))
        nsec = builder.load(builder.gep(ts, [zero, ir.Constant(i32, 1)]))
        return builder.add(builder.mul(sec, ir.Constant(i64, 1_000_000_000)), nsec)

    return sig, codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def _cpu_relax(typingctx):
    """``pause`` on x86 (a spin-wait hint that frees the sibling hyperthread);
    nothing elsewhere."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


# --- the ring --------------------------------------------------------------------


@njit(nogil=True, cache=True)
def _align(n):
    return (n + (ALIGN - 1)) & ~(ALIGN - 1)


@njit(nogil=True, cache=True)
def copy_bytes(dst, dst_offset, src, src_offset, nbytes):
    """``memcpy`` between uint8 arrays, without the GIL."""
    if nbytes > 0:
        _memcpy(dst, dst_offset, src, src_offset, nbytes)


@njit(nogil=True, cache=True)
def ring_put(ctrl, data, data64, kind, tag, msg_nbytes, stamp, payload, offset, started,
             max_chunk, min_chunk):
    """Write as much of one message as fits, from byte ``offset`` of ``payload``.

    ``started``: its first record (the one with the stamp) is already out.
    Returns ``(offset, started, poke)``: the new offset, whether the first
    record is out now, and whether the consumer sleeps and must be poked.
    The message is complete when ``started`` and ``offset == msg_nbytes``.
    A message of at most ``max_chunk`` bytes is one record (the receiver
    copies it straight into the posted buffer); a larger one is cut into
    chunks of at most ``max_chunk``, each cut to the room there is but not
    below ``min_chunk`` (or the rest), so a nearly full ring does not shred it.
    """
    cap = data.size
    head = np.int64(ctrl[HEAD])  # our own word: a plain load
    wrote = False
    while not (started and offset == msg_nbytes):
        tail = _load_acquire(ctrl, TAIL)
        free = cap - (head - tail) - RESERVE_NBYTES
        pos = head & (cap - 1)
        contiguous = cap - pos
        room = min(free, contiguous)
        hdr = HEADER_NBYTES + (0 if started else stamp.size)
        rest = msg_nbytes - offset
        if not started and rest <= max_chunk:
            want = least = rest  # a message that fits one record is never split
        else:
            want, least = min(rest, max_chunk), min(rest, min_chunk)
        if room < _align(hdr + least):
            if contiguous < cap and free >= contiguous + _align(hdr + least):
                # Not enough before the end, enough after it: pad to the end.
                data64[pos >> 3] = KIND_PAD | (contiguous << 16)
                head += contiguous
                continue
            break
        chunk = min(want, room - hdr)
        rec = _align(hdr + chunk)
        w = pos >> 3
        if started:
            data64[w] = KIND_MORE | (rec << 16)
        else:
            data64[w] = np.int64(kind) | (np.int64(stamp.size) << 8) | (rec << 16)
            for i in range(stamp.size):
                data[pos + HEADER_NBYTES + i] = stamp[i]
        data64[w + 1] = tag
        data64[w + 2] = msg_nbytes
        data64[w + 3] = chunk
        copy_bytes(data, pos + hdr, payload, offset, chunk)
        head += rec
        offset += chunk
        started = True
        wrote = True
        # Publish record by record: the consumer copies one out while we write the next.
        _store_release(ctrl, HEAD, head)
    poke = False
    if wrote:
        _store_release(ctrl, HEAD, head)
        _fence()  # Dekker: HEAD before reading ASLEEP
        poke = _load_acquire(ctrl, ASLEEP) != 0
    return offset, started, poke


@njit(nogil=True, cache=True)
def ring_next(ctrl, data64, cursor):
    """Look at the record at ``cursor``, the consumer's read position (ahead of
    TAIL while records are lent out), skipping PAD records.

    Returns ``(pos, word0, tag, msg_nbytes, chunk_nbytes, cursor)``: ``pos``
    is -1 when there is nothing more; ``cursor`` is where the record starts.
    """
    cap = data64.size * 8
    while True:
        if _load_acquire(ctrl, HEAD) == cursor:
            return -1, 0, np.uint64(0), 0, 0, cursor
        pos = cursor & (cap - 1)
        w = pos >> 3
        word0 = np.int64(data64[w])
        if word0 & 0xFF == KIND_PAD:
            cursor += word0 >> 16
            continue
        return pos, word0, data64[w + 1], np.int64(data64[w + 2]), np.int64(data64[w + 3]), cursor


@njit(nogil=True, cache=True)
def ring_free(ctrl, tail):
    """Give the producer back everything before ``tail`` (after the copies out);
    returns whether it waits for room and must be poked."""
    _store_release(ctrl, TAIL, tail)
    _fence()  # Dekker: TAIL before reading BLOCKED
    return _load_acquire(ctrl, BLOCKED) != 0


@njit(nogil=True, cache=True)
def ring_set_flag(ctrl, word, value):
    """Set ASLEEP or BLOCKED; when setting, returns whether the other side has
    work for us meanwhile (data to read / room to write), after a fence."""
    _store_release(ctrl, word, value)
    if value == 0:
        return False
    _fence()
    if word == ASLEEP:
        return _load_acquire(ctrl, HEAD) != np.int64(ctrl[TAIL])
    return True  # BLOCKED: the caller retries its write, which rereads TAIL


@njit(nogil=True, cache=True)
def rings_set_flag(region64, stride_words, count, word, value):
    """ASLEEP := value on every inbound ring of a region; when setting, returns
    whether any ring has data (checked after the fence)."""
    for k in range(count):
        _store_release(region64, k * stride_words + word, value)
    if value == 0:
        return False
    _fence()
    for k in range(count):
        base = k * stride_words
        if _load_acquire(region64, base + HEAD) != np.int64(region64[base + TAIL]):
            return True
    return False


@njit(nogil=True, cache=True)
def spin_ready(region64, stride_words, count, epoch, seen_epoch, spin_until_ns, yield_until_ns):
    """Poll the inbound rings without the GIL until one has data, ``epoch[0]``
    moves off ``seen_epoch`` (another thread made progress), or time runs out:
    busy until ``spin_until_ns`` (``pause`` between polls), then with
    ``sched_yield`` between polls until ``yield_until_ns`` (``time.monotonic_ns``
    clock). Returns True if there is something to do, False on time out."""
    i = 0
    now = 0
    while True:
        for k in range(count):
            base = k * stride_words
            if _load_acquire(region64, base + HEAD) != np.int64(region64[base + TAIL]):
                return True
        if _load_acquire(epoch, 0) != seen_epoch:
            return True
        if (i & 15) == 0:
            now = _monotonic_ns()
            if now >= yield_until_ns:
                return False
        i += 1
        if now < spin_until_ns:
            _cpu_relax()
        else:
            _sched_yield()


@njit(nogil=True, cache=True)
def ring_bye(ctrl, data64):
    """Publish ``BYE`` (it uses the reserved room, so it always fits); returns
    whether the consumer sleeps and must be poked."""
    cap = data64.size * 8
    head = np.int64(ctrl[HEAD])
    if cap - (head - _load_acquire(ctrl, TAIL)) < ALIGN:  # cannot happen: RESERVE_NBYTES
        return False
    data64[(head & (cap - 1)) >> 3] = KIND_BYE | (ALIGN << 16)
    _store_release(ctrl, HEAD, head + ALIGN)
    _fence()
    return _load_acquire(ctrl, ASLEEP) != 0


def ring_nbytes_for(inline_nbytes: int) -> int:
    """Ring capacity that holds two records of ``inline_nbytes`` (double buffering)."""
    need = 2 * (inline_nbytes + HEADER_NBYTES + 256 + ALIGN) + RESERVE_NBYTES
    return max(1 << 16, 1 << (need - 1).bit_length())


def ring_index(owner: int, peer: int) -> int:
    """Index of the ring from ``peer`` in ``owner``'s region."""
    return peer if peer < owner else peer - 1


class RingViews:
    """Views of one ring in a region (uint8): its control words and its data
    (bytes and words). Ring ``index`` of a region starts at ``index *
    (CTRL_NBYTES + capacity)``."""

    __slots__ = ("ctrl", "data", "data64")

    def __init__(self, region: np.ndarray, index: int, capacity: int):
        start = index * (CTRL_NBYTES + capacity)
        self.ctrl = region[start:start + CTRL_NBYTES].view(np.uint64)
        self.data = region[start + CTRL_NBYTES:start + CTRL_NBYTES + capacity]
        self.data64 = self.data.view(np.uint64)
