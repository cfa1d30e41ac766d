"""SparseCOO: a sparse array in torch's COO layout (hybrid sparse/dense).

``indices`` is int64 ``[sparse_dims, nnz]``, ``values`` is ``[nnz, *dense_shape]``
and ``shape`` is ``sparse_shape + dense_shape``, as in ``torch.sparse_coo_tensor``.
An uncoalesced array may repeat an index (the entries add up); :meth:`coalesce`
sorts the indices and sums duplicates with a Numba kernel. ``pg.allreduce`` and
``nc.all_reduce`` take SparseCOO arrays (SUM only). Indices and values may be
CUDA arrays; the collective then stages them through host memory.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .arrays import is_device_array
from ..dtypes import dtype_name, is_half, is_supported
from ..kernels.sparse import _coalesce_kernel

__all__ = ["SparseCOO"]


class SparseCOO:
    """A COO sparse array: ``indices`` int64 ``[sparse_dims, nnz]``, ``values``
    ``[nnz, *shape[sparse_dims:]]``, ``shape``.

    Parameters
    ----------
    indices : array-like of integers, ``[sparse_dims, nnz]``.
    values : array-like, ``[nnz, *dense_shape]``.
    shape : the full shape; inferred (max index + 1 per sparse dim) when None.
    """

    __slots__ = ("indices", "values", "shape", "_coalesced")

    def __init__(self, indices, values, shape: Sequence[int] | None = None, *,
                 is_coalesced: bool = False):
        on_device = is_device_array(indices) or is_device_array(values)
        if on_device:
            host_indices = _host(indices)
        else:
            indices = host_indices = np.asarray(indices)
            values = np.asarray(values)
        if host_indices.ndim != 2:
            raise ValueError(f"SparseCOO: indices must be 2-D [sparse_dims, nnz], got shape "
                             f"{tuple(host_indices.shape)}")
        if host_indices.dtype.kind not in "iu":
            raise TypeError(f"SparseCOO: indices must be integers, got "
                            f"{dtype_name(host_indices.dtype)}")
        if not on_device and host_indices.dtype != np.int64:
            indices = host_indices = host_indices.astype(np.int64)
        sparse_dims, nnz = host_indices.shape
        if len(values.shape) < 1 or values.shape[0] != nnz:
            raise ValueError(f"SparseCOO: values must have nnz = {nnz} rows, got shape "
                             f"{tuple(values.shape)}")
        if not is_supported(values.dtype):
            raise TypeError(f"SparseCOO: invalid tensor type: dtype {dtype_name(values.dtype)} "
                            "is not supported")
        dense_shape = tuple(values.shape[1:])
        if shape is None:
            sparse_shape = tuple(int(m) + 1 for m in host_indices.max(axis=1)) if nnz else \
                (0,) * sparse_dims
            shape = sparse_shape + dense_shape
        shape = tuple(int(s) for s in shape)
        if len(shape) != sparse_dims + len(dense_shape) or shape[sparse_dims:] != dense_shape:
            raise ValueError(f"SparseCOO: shape {shape} does not fit {sparse_dims} sparse "
                             f"dims and values of shape {tuple(values.shape)}")
        if nnz and (host_indices.min() < 0 or np.any(host_indices.max(axis=1) >=
                                                     np.array(shape[:sparse_dims]))):
            raise ValueError(f"SparseCOO: indices out of range for shape {shape}")
        self.indices, self.values, self.shape = indices, values, shape
        self._coalesced = bool(is_coalesced)

    # -- description ---------------------------------------------------------------
    @property
    def sparse_dim(self) -> int:
        return self.indices.shape[0]

    @property
    def dense_dim(self) -> int:
        return len(self.shape) - self.sparse_dim

    @property
    def nnz(self) -> int:
        return self.indices.shape[1]

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def on_device(self) -> bool:
        return is_device_array(self.values)

    def is_coalesced(self) -> bool:
        """True when the indices are sorted and unique (set by :meth:`coalesce`)."""
        return self._coalesced

    def __repr__(self):
        return (f"SparseCOO(shape={self.shape}, nnz={self.nnz}, dtype={dtype_name(self.dtype)}"
                f"{', coalesced' if self._coalesced else ''})")

    # -- conversions ---------------------------------------------------------------
    def coalesce(self) -> SparseCOO:
        """A new SparseCOO with sorted, unique indices (duplicates summed)."""
        if self._coalesced:
            return self
        indices, values = coalesce_entries(_host(self.indices), _host(self.values),
                                           self.shape[:self.sparse_dim])
        return SparseCOO(indices, values, self.shape, is_coalesced=True)

    def to_dense(self) -> np.ndarray:
        """The dense NumPy array (duplicates summed)."""
        c = self.coalesce()
        out = np.zeros(self.shape, self.dtype)
        out[tuple(c.indices)] = c.values
        return out

    @classmethod
    def from_dense(cls, a, sparse_dims: int = 1) -> SparseCOO:
        """The entries of ``a`` whose dense part is not all zero, coalesced."""
        a = np.asarray(a)
        if not 1 <= sparse_dims <= max(a.ndim, 1):
            raise ValueError(f"SparseCOO.from_dense: sparse_dims must be in [1, {a.ndim}], "
                             f"got {sparse_dims}")
        rows = a.reshape(a.shape[:sparse_dims] + (-1,))
        mask = np.any(rows != 0, axis=-1)
        indices = np.array(np.nonzero(mask), dtype=np.int64).reshape(sparse_dims, -1)
        return cls(indices, a[tuple(indices)], a.shape, is_coalesced=True)

    def to_scipy(self):
        """A ``scipy.sparse.coo_array`` (2 sparse dims, no dense dims; SciPy needed)."""
        import scipy.sparse

        if self.sparse_dim != 2 or self.dense_dim != 0:
            raise ValueError(f"SparseCOO.to_scipy: SciPy COO arrays are 2-D with no dense "
                             f"dims; this one has {self.sparse_dim} sparse and "
                             f"{self.dense_dim} dense dims")
        return scipy.sparse.coo_array((_host(self.values), tuple(_host(self.indices))),
                                      shape=self.shape)

    @classmethod
    def from_scipy(cls, m) -> SparseCOO:
        """From any ``scipy.sparse`` matrix or array (converted to COO)."""
        coo = m.tocoo()
        indices = np.vstack([coo.row, coo.col]).astype(np.int64)
        return cls(indices, np.asarray(coo.data), coo.shape)

    @classmethod
    def _trusted(cls, indices, values, shape, is_coalesced: bool) -> SparseCOO:
        """A SparseCOO from arrays the library built itself (no checks)."""
        sp = object.__new__(cls)
        sp.indices, sp.values, sp.shape, sp._coalesced = indices, values, tuple(shape), \
            is_coalesced
        return sp

    def copy(self) -> SparseCOO:
        """A copy with its own indices and values."""
        return SparseCOO._trusted(self.indices.copy(), self.values.copy(), self.shape,
                                  self._coalesced)

    def _assign(self, other: SparseCOO) -> None:
        """Take ``other``'s entries (the collectives update their inputs in place)."""
        self.indices, self.values, self._coalesced = other.indices, other.values, \
            other._coalesced


def coalesce_entries(indices: np.ndarray, values: np.ndarray, sparse_shape: Sequence[int]):
    """Sorted unique ``indices`` and summed ``values`` (host arrays).

    float16/bfloat16 values are summed in float32 and rounded once; bool is a
    logical or, as torch sums bool.
    """
    nnz = indices.shape[1]
    dense_shape = values.shape[1:]
    if nnz == 0:
        return indices.astype(np.int64).reshape(len(sparse_shape), 0), values
    keys = np.ravel_multi_index(tuple(indices), tuple(sparse_shape))
    if nnz == 1 or bool(np.all(keys[1:] > keys[:-1])):
        # Already sorted and unique (e.g. from_dense, or a gradient's rows): no kernel.
        return indices.astype(np.int64, copy=False), values
    rows = np.ascontiguousarray(values).reshape(nnz, -1)
    work_dtype = np.float32 if is_half(values.dtype) else (
        np.uint8 if values.dtype == np.bool_ else values.dtype)
    out_keys, out_rows = _coalesce_kernel(keys.astype(np.int64), rows.astype(work_dtype,
                                                                             copy=False))
    if values.dtype == np.bool_:
        out_rows = out_rows != 0
    out_values = out_rows.astype(values.dtype, copy=False).reshape((-1,) + dense_shape)
    out_indices = np.array(np.unravel_index(out_keys, tuple(sparse_shape)),
                           dtype=np.int64).reshape(len(sparse_shape), -1)
    return out_indices, out_values


def _host(a) -> np.ndarray:
    return a.copy_to_host() if is_device_array(a) else np.asarray(a)
