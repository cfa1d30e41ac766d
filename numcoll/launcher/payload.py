"""How a rank's function travels to its process: cloudpickle, with every code
object keeping the name of the file it came from.

A function the ranks cannot import (from ``__main__``, a notebook cell,
``python -c``, ``exec``) is pickled by value, code object and all. cloudpickle
3.1 replaces the ``co_filename`` of every code object it pickles with
``"<dynamic-code>"`` (for reproducible payloads), so a rank's traceback would
read ``File "<dynamic-code>", line 4, in step`` with no source line whatever
the caller wrote. :class:`_Pickler` pickles each code object as cloudpickle
does and carries the file name beside it; :func:`_code_with_filename` puts it
back when the rank loads the payload. Older cloudpickles, which kept the name,
give the same result.
"""

from __future__ import annotations

import io
import types
from collections import ChainMap

import cloudpickle

__all__ = ["dumps"]


def _code_with_filename(rebuild, rebuild_args, filename: str) -> types.CodeType:
    """The rank's side: the code object cloudpickle made, under its own file name."""
    code = rebuild(*rebuild_args)
    return code if code.co_filename == filename else code.replace(co_filename=filename)


def _reduce_code(code: types.CodeType):
    rebuild, rebuild_args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)[:2]
    return _code_with_filename, (rebuild, rebuild_args, code.co_filename)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


def dumps(obj) -> bytes:
    """``cloudpickle.dumps(obj)``, keeping the file names of the code it carries
    (``pickle.loads``/``cloudpickle.loads`` reads it back)."""
    with io.BytesIO() as buffer:
        _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
        return buffer.getvalue()
