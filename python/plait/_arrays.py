"""The one place that knows numpy, torch and cupy buffers.

Everything crosses into the native core as a numpy array (a view, never a copy) plus an optional
dtype name for element types numpy lacks (bfloat16). torch and cupy are imported lazily, only
when such an object is passed.
"""
import numpy as np

from . import _errors

_BF16_NAMES = ("bfloat16",)


def _module_of(obj):
    return type(obj).__module__.split(".", 1)[0]


class _TensorWindow:
    """A numpy view of a torch tensor's bytes that keeps the tensor alive.

    Not tensor.numpy(): that marks the tensor's storage non-resizable for good, which breaks
    FSDP (it frees and re-allocates parameters by resizing their storage).
    """

    __slots__ = ("__array_interface__", "_owner")

    def __init__(self, t, typestr):
        self._owner = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.numel(),),
                                    "typestr": typestr, "version": 3}


_TORCH_TYPESTR = None


def _torch_typestr(torch, dtype):
    global _TORCH_TYPESTR
    if _TORCH_TYPESTR is None:
        _TORCH_TYPESTR = {torch.float16: "<f2", torch.bfloat16: "<u2", torch.float32: "<f4",
                          torch.float64: "<f8", torch.int8: "|i1", torch.uint8: "|u1",
                          torch.int32: "<i4", torch.int64: "<i8", torch.bool: "|b1"}
    return _TORCH_TYPESTR.get(dtype)


def to_numpy(obj, name):
    """(numpy view, dtype override or "") of a numpy array or torch CPU tensor."""
    if type(obj) is np.ndarray:
        return obj, ""
    mod = _module_of(obj)
    if mod == "torch":
        import torch
        if obj.device.type != "cpu":
            raise _errors.InvalidArgument(
                f"{name} is a torch tensor on {obj.device}: this plait build has no GPU path "
                f"(plait.build_info()['cuda'] is False); pass CPU tensors")
        if not obj.is_contiguous():
            raise _errors.InvalidArgument(f"{name} is not contiguous (call .contiguous() first)")
        typestr = _torch_typestr(torch, obj.dtype)
        if typestr is None:
            raise _errors.InvalidArgument(f"{name} has unsupported dtype {obj.dtype}")
        view = (np.asarray(_TensorWindow(obj, typestr)) if obj.numel()
                else np.empty(0, dtype=typestr))
        return view, "bfloat16" if obj.dtype == torch.bfloat16 else ""
    if mod == "cupy" or hasattr(obj, "__cuda_array_interface__"):
        raise _errors.InvalidArgument(
            f"{name} is a GPU array but this plait build has no GPU path "
            f"(plait.build_info()['cuda'] is False)")
    if isinstance(obj, np.ndarray):
        return obj, ""
    raise _errors.InvalidArgument(
        f"{name} must be a numpy array or a torch CPU tensor, got {type(obj).__name__}")


def empty_like(x, shape=None):
    """A new output of x's kind (numpy or torch) and dtype."""
    if type(x) is np.ndarray:
        return np.empty(x.shape if shape is None else shape, dtype=x.dtype)
    if _module_of(x) == "torch":
        import torch
        return torch.empty(tuple(x.shape) if shape is None else shape, dtype=x.dtype)
    return np.empty(x.shape if shape is None else shape, dtype=x.dtype)


def size_of(x):
    return int(x.size) if type(x) is np.ndarray else int(x.numel()) if _module_of(x) == "torch" else int(x.size)
