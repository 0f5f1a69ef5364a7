"""plait: collective communication with native kernels.

    import plait
    comm = plait.init()                 # RANK/WORLD_SIZE from plait-run or torchrun
    y = plait.allreduce(x)              # or comm.allreduce(x, out=x, op="max", async_op=True)

Collectives run over shared memory between the processes of one host; see docs/api.md.
This module is the facade: joining lives in _bootstrap, the communicators in _comm and _hier.
"""

import atexit as _atexit
import typing as _t

from . import _C, _bootstrap, _cuda, _flight
from ._comm import Communicator, Handle
from ._hier import HierCommunicator
from ._errors import InvalidArgument, MismatchError, PeerLostError, PlaitError, TimeoutError
from ._shared import empty, is_shared, zeros

__all__ = [
    "init",
    "finalize",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "get_default",
    "is_initialized",
    "algorithms",
    "build_info",
    "cuda_available",
    "Communicator",
    "HierCommunicator",
    "Handle",
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "alltoall",
    "send",
    "recv",
    "barrier",
    "split",
    "gather",
    "scatter",
    "allgatherv",
    "alltoallv",
    "allgather_object",
    "broadcast_object",
    "PlaitError",
    "InvalidArgument",
    "MismatchError",
    "TimeoutError",
    "PeerLostError",
    "empty",
    "zeros",
    "is_shared",
    "dump",
]
__version__ = "0.1.0"

_default = None
# PLAIT_TRACE: slices still in memory are written when the interpreter exits.
_atexit.register(_C.flush_traces)


def algorithms(collective: str, device: str = "cpu") -> _t.List[str]:
    """Algorithm names of a collective, in table order ("auto" picks among them).

    device="cuda": the GPU algorithms (empty on a CPU-only build): those over NCCL (one GPU per
    rank), then those over the CUDA IPC transport (ranks sharing a GPU, or PLAIT_GPU_TRANSPORT=ipc);
    a name both transports have ("ring") is listed once, where NCCL's table has it.
    """
    if device == "cpu":
        return _C.algorithms(collective, "shm")
    if device == "cuda":
        names = _C.algorithms(collective, "nccl")
        return names + [a for a in _C.algorithms(collective, "ipc") if a not in names]
    raise InvalidArgument(f"device must be 'cpu' or 'cuda', got {device!r}")


def build_info() -> _t.Dict[str, _t.Any]:
    """What this build and machine have.

    {'cuda': compiled with the CUDA path, 'cuda_devices': CUDA devices visible now (0 without a
    driver), 'nccl': NCCL's version when it loads, else None, 'nccl_path': where plait looks,
    'transports': [...], 'reduce_isa': 'avx512'|'avx2'|'portable'}
    """
    info = dict(_C.build_info())
    info["cuda_devices"] = _cuda.device_count()
    info["nccl"] = _cuda.nccl_version()
    info["nccl_path"] = _cuda.nccl_path() or None
    return info


def cuda_available() -> bool:
    """True when this build has the CUDA path and this process sees at least one CUDA device."""
    return _cuda.compiled() and _cuda.device_count() > 0


def init(
    rank: _t.Optional[int] = None,
    size: _t.Optional[int] = None,
    *,
    store: _t.Any = None,
    timeout: _t.Optional[float] = None,
    buffer_bytes: _t.Optional[int] = None,
    init_timeout: _t.Optional[float] = None,
    set_default: bool = True,
) -> _t.Union[Communicator, HierCommunicator]:
    """Joins (creates) a communicator of `size` ranks and makes it the default.

    rank/size default to RANK/WORLD_SIZE (plait-run, torchrun, mpirun). store: None (PLAIT_STORE,
    else MASTER_ADDR:MASTER_PORT+1 served by rank 0), a (host, port) pair, or a plait._store.Store.
    timeout: default deadline of every call in seconds (PLAIT_TIMEOUT, else 300). buffer_bytes:
    shared staging per rank (PLAIT_BUFFER_BYTES, else 4 MiB). Ranks on several hosts get a
    HierCommunicator with the same methods.
    """
    global _default
    comm = _bootstrap.connect(
        rank, size, store=store, timeout=timeout, buffer_bytes=buffer_bytes, init_timeout=init_timeout
    )
    if set_default:
        if _default is not None and not _default.closed:
            _default.finalize()
        _default = comm
    return comm


def is_initialized() -> bool:
    return _default is not None and not _default.closed


def get_default() -> _t.Union[Communicator, HierCommunicator]:
    if _default is None or _default.closed:
        raise PlaitError("plait is not initialized: call plait.init() first")
    return _default


def rank() -> int:
    """This process's rank in the default communicator."""
    return get_default().rank


def size() -> int:
    """The number of ranks of the default communicator."""
    return get_default().size


def local_rank() -> int:
    """This process's rank among the default communicator's ranks on this host."""
    comm = get_default()
    return comm.local.rank if isinstance(comm, HierCommunicator) else comm.rank


def local_size() -> int:
    """The number of the default communicator's ranks on this host."""
    comm = get_default()
    return comm.local.size if isinstance(comm, HierCommunicator) else comm.size


def finalize() -> None:
    """Closes the default communicator (queued calls finish first)."""
    global _default
    if _default is not None:
        _default.finalize()
        _default = None


def dump(
    comm: _t.Union[Communicator, HierCommunicator, None] = None, path: _t.Optional[str] = None
) -> _t.Dict[str, _t.Any]:
    """The flight recorder's report of `comm` (default: the default communicator): every rank's
    last calls read from shared memory, the dead or frozen ones included, as a dict; written as
    JSON to `path` when given."""
    return _flight.dump(get_default() if comm is None else comm, path)


def allreduce(x: _t.Any, out: _t.Any = None, **kw: _t.Any) -> _t.Any:
    return get_default().allreduce(x, out, **kw)


def reduce_scatter(x: _t.Any, out: _t.Any = None, **kw: _t.Any) -> _t.Any:
    return get_default().reduce_scatter(x, out, **kw)


def allgather(x: _t.Any, out: _t.Any = None, **kw: _t.Any) -> _t.Any:
    return get_default().allgather(x, out, **kw)


def broadcast(x: _t.Any, root: int = 0, **kw: _t.Any) -> _t.Any:
    return get_default().broadcast(x, root, **kw)


def reduce(x: _t.Any, root: int = 0, **kw: _t.Any) -> _t.Any:
    return get_default().reduce(x, root, **kw)


def alltoall(x: _t.Any, out: _t.Any = None, **kw: _t.Any) -> _t.Any:
    return get_default().alltoall(x, out, **kw)


def send(x: _t.Any, peer: int, **kw: _t.Any) -> _t.Any:
    return get_default().send(x, peer, **kw)


def recv(out: _t.Any, peer: int, **kw: _t.Any) -> _t.Any:
    return get_default().recv(out, peer, **kw)


def barrier(**kw: _t.Any) -> _t.Any:
    return get_default().barrier(**kw)


def split(color: _t.Optional[int], key: int = 0, **kw: _t.Any) -> _t.Any:
    return get_default().split(color, key, **kw)


def gather(x: _t.Any, root: int = 0) -> _t.Any:
    return get_default().gather(x, root)


def scatter(x: _t.Any = None, root: int = 0) -> _t.Any:
    return get_default().scatter(x, root)


def allgatherv(x: _t.Any, counts: _t.Optional[_t.Sequence[int]] = None) -> _t.Any:
    return get_default().allgatherv(x, counts)


def alltoallv(
    x: _t.Any, send_counts: _t.Sequence[int], recv_counts: _t.Optional[_t.Sequence[int]] = None
) -> _t.Any:
    return get_default().alltoallv(x, send_counts, recv_counts)


def allgather_object(obj: _t.Any) -> list:
    return get_default().allgather_object(obj)


def broadcast_object(obj: _t.Any = None, root: int = 0) -> _t.Any:
    return get_default().broadcast_object(obj, root)
