"""How torch tensors cross into plait: dtypes, layouts, temporaries and copy-backs.

plait takes C-contiguous arrays of float16, bfloat16, float32, float64, int8, uint8, int32,
int64 and bool. Everything else torch can hand a backend is mapped here:
- data movement (broadcast, gathers, all-to-all, send/recv) moves raw bytes, so any dtype goes;
- reductions widen int16/uint16 to int32 and uint32 to int64 (sums and products wrap alike
  after the cast back), reinterpret uint64 as int64 for sums and products (same bits mod 2^64),
  and see complex tensors as pairs of floats (sum-like ops only, as c10d requires);
- a non-contiguous output gets a contiguous temporary that is copied back into the view after
  the call, so elements of the same storage outside the view are never written;
- an input overlapping its output other than in plait's in-place forms is copied first.
"""

import numpy as np
import torch

from .. import _arrays

NATIVE = _arrays.torch_dtypes(torch)  # torch dtype -> plait's name, from plait's one dtype table
_WIDEN = {torch.int16: torch.int32}
for _name, _wide in (("uint16", torch.int32), ("uint32", torch.int64)):
    if hasattr(torch, _name):
        _WIDEN[getattr(torch, _name)] = _wide
_REINTERPRET = {torch.uint64: torch.int64} if hasattr(torch, "uint64") else {}


class _Memory:
    """A numpy-visible window on a tensor's memory that keeps the tensor alive.

    Not tensor.numpy(): that marks the tensor's storage non-resizable for good, and FSDP frees
    and re-allocates its unsharded parameters by resizing their storage to 0 and back.
    """

    __slots__ = ("__array_interface__", "_owner")

    def __init__(self, t, typestr, n):
        self._owner = t
        self.__array_interface__ = {
            "data": (t.data_ptr(), False),
            "shape": (n,),
            "typestr": typestr,
            "version": 3,
        }


_TYPESTR = {dt: _arrays.DTYPES[name] for dt, name in NATIVE.items()}


def _window(t, typestr, n):
    if n == 0:
        return np.empty(0, dtype=typestr)
    return np.asarray(_Memory(t, typestr, n))


_WINDOWS = {}
_WINDOWS_MAX = 512


def window(t):
    """np_of(t)[0] for the hot path: a cached window on t's bytes, keyed by address, dtype and
    size, that does not keep t alive. Sound because it is only ever used while the tensor that
    occupies exactly those bytes is alive (the op holds it until plait is done with it); saves
    about 1 us a call for tensors that come back (DDP's buckets, a training loop's buffers)."""
    key = (t.data_ptr(), t.dtype, t.numel())
    w = _WINDOWS.get(key)
    if w is None:
        if len(_WINDOWS) >= _WINDOWS_MAX:
            _WINDOWS.clear()
        w = _WINDOWS[key] = _window(_Address(key[0]), _TYPESTR[t.dtype], key[2])
    return w


class _Address:
    __slots__ = ("_p",)

    def __init__(self, p):
        self._p = p

    def data_ptr(self):
        return self._p


def np_of(t):
    """(flat numpy view, plait dtype name or None) of a contiguous CPU tensor of a plait dtype."""
    check_cpu(t)
    return _window(t, _TYPESTR[t.dtype], t.numel()), "bfloat16" if t.dtype == torch.bfloat16 else None


def raw(t):
    """A contiguous tensor's elements as a flat uint8 tensor (a view; any dtype)."""
    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def bytes_of(t):
    """A contiguous tensor's bytes as a flat uint8 numpy view (any dtype)."""
    check_cpu(t)
    return _window(t, "|u1", t.numel() * t.element_size())


def check_cpu(t, where="plait"):
    if not t.is_cpu:
        from ._errors import PlaitUnsupportedError

        raise PlaitUnsupportedError(
            f"{where}: tensor on {t.device}; plait takes CUDA tensors in all_reduce, reduce, reduce_scatter, "
            f"broadcast, all_gather, all_to_all (even splits) and send/recv only (contiguous; reductions: "
            f"plait's dtypes and ops), CPU tensors everywhere"
        )


def source(t):
    """t, contiguous, with its conjugation resolved (a copy only when needed)."""
    if t.is_conj():
        t = t.resolve_conj()
    return t if t.is_contiguous() else t.contiguous()


def sink(t, op):
    """A contiguous tensor to receive t's values; a temporary copied back into t when t is not."""
    if t.is_contiguous():
        return t
    tmp = torch.empty(t.shape, dtype=t.dtype)
    op.after.append(lambda: t.copy_(tmp))
    return tmp


def write_bytes(dst, data):
    """Copies data (a uint8 tensor of dst's byte size) into dst, whatever dst's layout."""
    if dst.is_contiguous():
        raw(dst).copy_(data)
    else:
        tmp = torch.empty(dst.shape, dtype=dst.dtype)
        raw(tmp).copy_(data)
        dst.copy_(tmp)


def overlaps(a, b):
    """Whether two contiguous tensors share bytes."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.numel() * b.element_size() and pb < pa + a.numel() * a.element_size()


def same_bytes(a, b):
    return a.data_ptr() == b.data_ptr() and a.numel() * a.element_size() == b.numel() * b.element_size()


def is_block(part, whole, index):
    """Whether part is exactly block `index` of whole (cut into equal blocks of part's size)."""
    nb = part.numel() * part.element_size()
    return part.data_ptr() == whole.data_ptr() + index * nb


def flat_view(tensors):
    """One contiguous 1-D tensor over tensors that lie back to back in one storage, else None."""
    first = tensors[0]
    dtype = first.dtype
    ptr = first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if (
            t.dtype != dtype
            or not t.is_contiguous()
            or t.data_ptr() != ptr
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
        ptr += t.numel() * t.element_size()
    total = sum(t.numel() for t in tensors)
    base = first.detach()
    return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), base.storage_offset(), (total,), (1,))


def wire_dtype(dtype, additive):
    """(dtype plait reduces in, how) for a reduction on dtype: how is None (native), 'widen',
    'reinterpret' or 'complex'; raises for dtypes no plait reduction can do."""
    if dtype in NATIVE:
        return dtype, None
    if dtype.is_complex:
        return torch.view_as_real(torch.empty(0, dtype=dtype)).dtype, "complex"
    if dtype in _WIDEN:
        return _WIDEN[dtype], "widen"
    if dtype in _REINTERPRET and additive:
        return _REINTERPRET[dtype], "reinterpret"
    return None, None
