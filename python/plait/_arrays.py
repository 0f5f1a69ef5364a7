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
        if obj.dtype == torch.bfloat16:
            return obj.view(torch.int16).numpy(), "bfloat16"
        return obj.numpy(), ""
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
