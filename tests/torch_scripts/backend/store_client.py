"""torch's TCPStore client against numcoll's TCPStore server (its own process:
some of torch's client calls hold the GIL while they wait, so the server must
not share the interpreter): every query torch 2.13 sends, with torch's answers.

    python store_client.py PORT
"""

import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

port = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
other = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False,
                      timeout=timedelta(seconds=10))   # joins: add("init/", 1)
store.set("k", b"v1")
assert store.get("k") == b"v1"
assert store.add("n", 5) == 5 and store.add("n", -2) == 3
assert store.compare_set("k", b"v1", b"v2") == b"v2"
assert store.compare_set("k", b"nope", b"v3") == b"v2"
assert store.compare_set("missing", b"x", b"y") == b"x"
assert store.check(["k"]) and not store.check(["k", "absent"])
store.wait(["k", "n"])
start = time.monotonic()
try:
    store.wait(["absent"], timedelta(milliseconds=300))
    raise AssertionError("wait did not time out")
except dist.DistStoreError as exc:
    assert "wait timeout after 300ms" in str(exc), exc
assert 0.25 < time.monotonic() - start < 3
store.set("after-cancel", b"ok")   # the connection is still in step after CANCEL_WAIT
assert store.get("after-cancel") == b"ok"
store.append("a", b"xy")
store.append("a", b"z")
assert store.multi_get(["a", "k"]) == [b"xyz", b"v2"]
store.multi_set(["m1", "m2"], [b"1", b"2"])
assert store.get("m2") == b"2"
assert store.delete_key("m2") and not store.delete_key("m2")
keys = set(store.list_keys())
assert {"k", "n", "a", "m1"} <= keys, keys
# num_keys counts every key, "init/" (the join counter, which list_keys leaves out) too
assert store.num_keys() == len(keys) + 1, (store.num_keys(), keys)
store.queue_push("q", b"first")
store.queue_push("q", b"second")
assert store.queue_len("q") == 2
assert store.queue_pop("q") == b"first" and store.queue_pop("q", block=False) == b"second"
try:
    store.queue_pop("q", block=False)
    raise AssertionError("pop of an empty queue")
except dist.QueueEmptyError:
    pass
threading.Timer(0.3, lambda: other.set("late", b"hello")).start()
assert store.get("late") == b"hello"   # a parked WAIT, woken by another client
print("ok", flush=True)
