"""plait.empty / plait.zeros: arrays in memory every rank on the host can map.

A collective whose buffers live here lets a single_copy algorithm read and write peers' data with
plain loads and stores (non-temporal where nobody re-reads it) instead of kernel copies: on the
2-core VM a 64 MiB 2-rank allreduce or allgather takes about half the time (bench/RESULTS.md).
Any other buffer still works; per peer and per buffer, plait falls back to the kernel copy.
The memory is a memfd (no file in /dev/shm) and is freed when the last array viewing it is."""

from typing import Any, Sequence, Union

import numpy as np

from . import _C
from ._errors import InvalidArgument


def _shape(shape):
    try:
        dims = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"plait.empty: shape must be an int or a sequence of ints, got {shape!r}"
        ) from None
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"plait.empty: negative dimension in shape {dims}")
    return dims


def _count(shape):
    return int(np.prod(_shape(shape), dtype=np.int64))


def empty(shape: Union[int, Sequence[int]], dtype: Any = "float32") -> np.ndarray:
    """A C-contiguous numpy array of `shape` and `dtype` in plait shared memory. Its contents are
    zero (a fresh memfd), so this is also plait.zeros. Use it (or torch.from_numpy of it) for the
    buffers you pass to collectives again and again, e.g. gradient buckets."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise InvalidArgument(f"plait.empty: unknown dtype {dtype!r}: {e}") from None
    dims = _shape(shape)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    buf = _C.SharedBuffer(nbytes)  # the array's base: the region lives as long as any view of it
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes).view(dt).reshape(dims)


zeros = empty


def is_shared(x: Any) -> bool:
    """True when all of array x (numpy, or anything with __array_interface__) lies in memory from
    plait.empty, so peers can map it."""
    a = np.asarray(x)
    if a.size == 0:
        return False
    lo, hi = np.byte_bounds(a) if hasattr(np, "byte_bounds") else np.lib.array_utils.byte_bounds(a)
    return bool(_C.is_shared(lo, hi - lo))
