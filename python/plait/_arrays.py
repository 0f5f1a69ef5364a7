"""The one place that knows numpy, torch and cupy buffers.

Host arrays cross into the native core as a numpy array (a view, never a copy) plus an optional
dtype name for element types numpy lacks (bfloat16). Device arrays (cupy and anything with
__cuda_array_interface__, torch CUDA tensors) become a GpuArray: pointer, bytes, device, dtype
and the stream to order the work on, holding the array so it outlives the call. torch and cupy
are imported lazily, only when such an object is passed.
"""

import sys

import numpy as np

from . import _errors

# The one dtype table: plait's name -> the numpy typestr of the buffer plait reads (bfloat16, which
# numpy lacks, travels as its uint16 bits with the name passed beside it). Everything else (item
# sizes, torch's dtypes, __cuda_array_interface__ typestrs) is derived from it.
DTYPES = {
    "float16": "<f2",
    "bfloat16": "<u2",
    "float32": "<f4",
    "float64": "<f8",
    "int8": "|i1",
    "uint8": "|u1",
    "int32": "<i4",
    "int64": "<i8",
    "bool": "|b1",
}
ITEMSIZE = {name: np.dtype(ts).itemsize for name, ts in DTYPES.items()}
# typestr -> name for device arrays; either byte-order mark for single bytes; bfloat16 is told
# apart from uint16 by the array's own dtype (see gpu_array).
_TYPESTR_DTYPE = {ts: name for name, ts in DTYPES.items() if name != "bfloat16"}
_TYPESTR_DTYPE.update({"<i1": "int8", "<u1": "uint8"})
_TORCH_NAMES = None


def torch_dtypes(torch):
    """{torch dtype: plait dtype name} for the dtypes plait reduces natively."""
    global _TORCH_NAMES
    if _TORCH_NAMES is None:
        _TORCH_NAMES = {getattr(torch, name): name for name in DTYPES}
    return _TORCH_NAMES


_TORCH_TENSOR = None  # torch.Tensor, once torch is imported
_STRIDED = None


def torch_host(t):
    """(address, bytes, dtype name) of t when it is a contiguous, non-empty torch CPU tensor of a
    dtype plait takes, else None: the small-message path hands plait its memory without building
    a numpy view of it (which costs more than the collective)."""
    global _TORCH_TENSOR, _STRIDED
    if _TORCH_TENSOR is None:
        torch = sys.modules.get("torch")
        if torch is None:  # not imported: t is no tensor
            return None
        torch_dtypes(torch)
        _TORCH_TENSOR, _STRIDED = torch.Tensor, torch.strided
    if type(t) is not _TORCH_TENSOR or not t.is_cpu or t.layout is not _STRIDED or not t.is_contiguous():
        return None
    name = _TORCH_NAMES.get(t.dtype)
    n = t.numel()
    if name is None or not n:
        return None
    return t.data_ptr(), n * ITEMSIZE[name], name


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
        self.__array_interface__ = {
            "data": (t.data_ptr(), False),
            "shape": (t.numel(),),
            "typestr": typestr,
            "version": 3,
        }


def _torch_typestr(torch, dtype):
    name = torch_dtypes(torch).get(dtype)
    return None if name is None else DTYPES[name]


def to_numpy(obj, name):
    """(numpy view, dtype override or "") of a numpy array or torch CPU tensor."""
    if type(obj) is np.ndarray:
        return obj, ""
    mod = _module_of(obj)
    if mod == "torch":
        import torch

        if obj.device.type != "cpu":
            raise _errors.InvalidArgument(
                f"{name} is a torch tensor on {obj.device}: plait takes CPU tensors and CUDA tensors"
            )
        if not obj.is_contiguous():
            raise _errors.InvalidArgument(f"{name} is not contiguous (call .contiguous() first)")
        typestr = _torch_typestr(torch, obj.dtype)
        if typestr is None:
            raise _errors.InvalidArgument(f"{name} has unsupported dtype {obj.dtype}")
        view = np.asarray(_TensorWindow(obj, typestr)) if obj.numel() else np.empty(0, dtype=typestr)
        return view, "bfloat16" if obj.dtype == torch.bfloat16 else ""
    if is_gpu(obj):
        raise _errors.InvalidArgument(f"{name} is a GPU array where a host array was expected")
    if isinstance(obj, np.ndarray):
        return obj, ""
    view = buffer_view(obj, name)
    if view is not None:
        return view, ""
    raise _errors.InvalidArgument(
        f"{name} must be a numpy array, a torch CPU tensor or a buffer (memoryview), got {type(obj).__name__}"
    )


def buffer_view(obj, name):
    """A numpy view of a buffer-protocol object (memoryview, bytearray, array.array), or None for
    an object without the protocol; InvalidArgument for a buffer numpy cannot describe."""
    try:
        mv = memoryview(obj)
    except TypeError:
        return None
    try:
        view = np.asarray(mv)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise _errors.InvalidArgument(
            f"{name} is a buffer of format {mv.format!r} that plait cannot read: {e}"
        ) from None
    if not view.flags.c_contiguous:
        raise _errors.InvalidArgument(f"{name} is a buffer that is not C-contiguous")
    return view


def empty_like(x, shape=None):
    """A new output of x's kind (numpy, torch on x's device, cupy on x's device) and dtype."""
    if type(x) is np.ndarray:
        return np.empty(x.shape if shape is None else shape, dtype=x.dtype)
    mod = _module_of(x)
    if mod == "torch":
        import torch

        return torch.empty(tuple(x.shape) if shape is None else shape, dtype=x.dtype, device=x.device)
    if mod == "cupy":
        import cupy

        with x.device:
            return cupy.empty(x.shape if shape is None else shape, dtype=x.dtype)
    if is_gpu(x):
        raise _errors.InvalidArgument(
            f"cannot allocate an output like a {type(x).__name__}: "
            "pass out= (a cupy array or a torch CUDA tensor)"
        )
    if not hasattr(x, "dtype"):  # a buffer (memoryview): its output is a numpy array
        x = buffer_view(x, "input")
        if x is None:
            raise _errors.InvalidArgument("input must be a numpy array, a torch CPU tensor or a buffer")
    return np.empty(x.shape if shape is None else shape, dtype=x.dtype)


def size_of(x):
    if type(x) is np.ndarray:
        return int(x.size)
    if _module_of(x) == "torch":
        return int(x.numel())
    if isinstance(x, memoryview):
        return x.nbytes // x.itemsize if x.itemsize else 0
    return int(x.size)


# -- device arrays ------------------------------------------------------------------------------
_DLPACK_GPU = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


class GpuArray:
    """A device array as plait's GPU path takes it. `owner` keeps the memory alive."""

    __slots__ = ("ptr", "nbytes", "itemsize", "device", "dtype", "stream", "owner", "kind", "count")

    def __init__(self, ptr, nbytes, itemsize, device, dtype, stream, owner, kind):
        self.ptr, self.nbytes, self.itemsize, self.device = int(ptr), int(nbytes), int(itemsize), int(device)
        self.dtype, self.stream, self.owner, self.kind = dtype, int(stream), owner, kind
        self.count = self.nbytes // self.itemsize if self.itemsize else 0

    def record_stream(self):
        """Tells torch's caching allocator that a torch tensor is in use on the current stream of
        its device (a no-op for other kinds), so that memory freed right after a call is not handed
        out again before the call ran there."""
        if self.kind == "torch":
            import torch

            self.owner.record_stream(torch.cuda.current_stream(self.device))

    def describe(self):
        where = f"GPU {self.device}" if self.device >= 0 else "an unknown GPU"
        return f"{self.kind} {self.dtype or 'unsupported dtype'} x {self.count} on {where}"


def is_gpu(obj):
    """True for objects that live on a CUDA device (without importing any GPU library)."""
    if type(obj) is np.ndarray:
        return False
    if _module_of(obj) == "torch":
        return getattr(getattr(obj, "device", None), "type", None) == "cuda"
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dl = getattr(obj, "__dlpack_device__", None)
    if dl is not None:
        try:
            return int(dl()[0]) in _DLPACK_GPU
        except Exception:  # noqa: BLE001 - a broken protocol method is not a device array
            return False
    return False


def _c_contiguous(shape, strides, itemsize):
    if strides is None:
        return True
    expect = itemsize
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def gpu_array(obj, name, pointer_device):
    """GpuArray for a device array; raises InvalidArgument saying what is wrong with it.

    pointer_device(ptr) -> device index, for __cuda_array_interface__ objects that do not say.
    """
    mod = _module_of(obj)
    if mod == "torch":
        import torch

        if not obj.is_contiguous():
            raise _errors.InvalidArgument(f"{name} is not contiguous (call .contiguous() first)")
        dev = obj.device.index if obj.device.index is not None else torch.cuda.current_device()
        return GpuArray(
            obj.data_ptr(),
            obj.numel() * obj.element_size(),
            obj.element_size(),
            dev,
            torch_dtypes(torch).get(obj.dtype),
            torch.cuda.current_stream(dev).cuda_stream,
            obj,
            "torch",
        )
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        ptr, _readonly = cai["data"]
        shape = tuple(cai["shape"])
        typestr = cai["typestr"]
        itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 0
        if not _c_contiguous(shape, cai.get("strides"), itemsize):
            raise _errors.InvalidArgument(f"{name} is not C-contiguous")
        count = 1
        for n in shape:
            count *= int(n)
        dtype = _TYPESTR_DTYPE.get(typestr)
        if typestr[1:] == "V2" and "bfloat16" in str(getattr(obj, "dtype", "")):
            dtype = "bfloat16"
        if mod == "cupy":
            import cupy

            device = int(obj.device.id)
            with cupy.cuda.Device(device):  # the current stream of the array's device, not the current one's
                stream = cupy.cuda.get_current_stream().ptr
        else:
            # CAI v3: "stream" is the producer's stream (None: already synchronised); order on it.
            s = cai.get("stream")
            device, stream = (pointer_device(ptr) if ptr else 0), (int(s) if s else 0)
        return GpuArray(ptr, count * itemsize, itemsize, device, dtype, stream, obj, mod)
    raise _errors.InvalidArgument(
        f"{name} is a CUDA array that offers only DLPack ({type(obj).__name__}); plait reads cupy arrays, "
        f"torch CUDA tensors and objects with __cuda_array_interface__"
    )
