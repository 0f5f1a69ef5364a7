"""What the GPU path needs from Python: where NCCL is, what this build and machine have.

Nothing here imports a GPU library. NCCL is found in the nvidia-nccl-cu13 wheel
(site-packages/nvidia/nccl/lib/libnccl.so.2) through importlib, else left to the system loader
("" lets dlopen search LD_LIBRARY_PATH and ld.so.cache); PLAIT_NCCL_PATH overrides both.
"""

import importlib.util
import os

from . import _C, _errors

GPU_COLLECTIVES = (
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "alltoall",
    "send",
    "recv",
)
# The collectives the CUDA IPC transport runs; the others need NCCL (one GPU per rank).
IPC_COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
_nccl_version = None  # cached after the first successful load


def compiled():
    return bool(_C.CUDA_COMPILED)


def device_count():
    return int(_C.cuda_device_count())


def nccl_path():
    env = os.environ.get("PLAIT_NCCL_PATH")
    if env:
        return env
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for base in (spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(base, "lib", "libnccl.so.2")
        if os.path.exists(lib):
            return lib
    return ""


def nccl_version():
    """NCCL's version as 'major.minor.patch' when it loads, else None (and on CPU-only builds)."""
    global _nccl_version
    if _nccl_version is None and compiled():
        try:
            v = int(_C.nccl_load(nccl_path()))
        except _errors.PlaitError:
            return None
        _nccl_version = f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return _nccl_version


def load_nccl():
    """Loads NCCL or raises PlaitError saying where it looked."""
    _C.nccl_load(nccl_path())
