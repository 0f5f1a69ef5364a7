"""plait: collective communication with native kernels.

    import plait
    comm = plait.init()                 # RANK/WORLD_SIZE from plait-run or torchrun
    y = plait.allreduce(x)              # or comm.allreduce(x, out=x, op="max", async_op=True)

Collectives run over shared memory between the processes of one host; see docs/api.md.
"""
import atexit
import json
import os

import numpy as np  # noqa: F401  (the facade's one dependency; arrays cross as numpy views)

from . import _C, _comm, _cuda, _errors, _flight, _hier, _hosts, _shm, _store
from ._comm import Communicator, Handle
from ._hier import HierCommunicator
from ._errors import InvalidArgument, MismatchError, PeerLostError, PlaitError, TimeoutError
from ._shared import empty, is_shared, zeros

__all__ = [
    "init", "finalize", "get_default", "is_initialized", "algorithms", "build_info",
    "cuda_available", "Communicator", "HierCommunicator", "Handle",
    "allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall", "send", "recv",
    "barrier", "split", "PlaitError", "InvalidArgument", "MismatchError", "TimeoutError",
    "PeerLostError", "empty", "zeros", "is_shared", "dump",
]
__version__ = "0.1.0"

_default = None
# PLAIT_TRACE: slices still in memory are written when the interpreter exits.
atexit.register(_C.flush_traces)


def algorithms(collective, device="cpu"):
    """Algorithm names of a collective, in table order ("auto" picks among them).

    device="cuda": the GPU algorithms (empty on a CPU-only build): those over NCCL (one GPU per
    rank), then those over the CUDA IPC transport (ranks sharing a GPU, or PLAIT_GPU_TRANSPORT=ipc);
    a name both transports have ("ring") is listed once, where NCCL's table has it.
    """
    if device == "cpu":
        return _C.algorithms(collective)
    if device == "cuda":
        names = _C.gpu_algorithms(collective)
        return names + [a for a in _C.ipc_algorithms(collective) if a not in names]
    raise InvalidArgument(f"device must be 'cpu' or 'cuda', got {device!r}")


def build_info():
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


def cuda_available():
    """True when this build has the CUDA path and this process sees at least one CUDA device."""
    return _cuda.compiled() and _cuda.device_count() > 0


def _env_int(name):
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise InvalidArgument(f"{name}={v!r} is not an integer") from None


def init(rank=None, size=None, *, store=None, timeout=None, buffer_bytes=None, init_timeout=None,
         set_default=True):
    """Joins (creates) a communicator of `size` ranks on this host and makes it the default.

    rank/size default to RANK/WORLD_SIZE (plait-run, torchrun). store: None (PLAIT_STORE, else
    MASTER_ADDR:MASTER_PORT+1 served by rank 0), a (host, port) pair, or a plait._store.Store.
    timeout: default deadline of every call in seconds (PLAIT_TIMEOUT, else 300). buffer_bytes:
    shared staging per rank (PLAIT_BUFFER_BYTES, else 4 MiB).
    """
    global _default
    if "OMPI_COMM_WORLD_SIZE" in os.environ:  # under mpirun: its ranks, unless a launcher set ours
        for ours, theirs in (("RANK", "RANK"), ("WORLD_SIZE", "SIZE"), ("LOCAL_RANK", "LOCAL_RANK"),
                             ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")):
            if f"OMPI_COMM_WORLD_{theirs}" in os.environ:
                os.environ.setdefault(ours, os.environ[f"OMPI_COMM_WORLD_{theirs}"])
    rank = _env_int("RANK") if rank is None else int(rank)
    size = _env_int("WORLD_SIZE") if size is None else int(size)
    if rank is None or size is None:
        raise InvalidArgument("plait.init needs rank and size (or RANK and WORLD_SIZE in the environment)")
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgument(f"rank {rank} is not in a world of {size}")
    # Checked before the rendezvous, so a rank never waits in it on a value it then refuses.
    if timeout is None:
        text = os.environ.get("PLAIT_TIMEOUT", "300")
        try:
            timeout = float(text)
        except ValueError:
            raise InvalidArgument(f"PLAIT_TIMEOUT={text!r} is not a number of seconds") from None
        timeout = _errors.seconds(timeout, f"PLAIT_TIMEOUT={text!r}", "calls never wait")
    else:
        timeout = _errors.seconds(timeout, "plait.init: timeout", "calls never wait")
    if init_timeout is None:
        init_timeout = max(timeout, 60.0)
    init_timeout = _errors.seconds(init_timeout, "plait.init: init_timeout", "init never waits")
    keep = []
    if isinstance(store, _store.Store) or all(hasattr(store, m) for m in ("add", "set", "get")):
        client = store  # plait's client, or an adapter (the torch backend wraps torch's store)
    else:
        if store is None:
            mpirun = _mpirun_store(rank)
            host, port, serve = mpirun or _store.store_from_env(rank)
            if mpirun and serve:  # a fresh port per init, announced over MPI: it ends with the communicator
                keep.append(_store.StoreServer(serve, port))
            elif serve:
                _serve_for_good(host, port)
        else:
            host, port = store
        client = _store.Store(host, port, timeout=init_timeout)
        keep.append(client)
    comm = _init_in(client, "plait", rank, size, timeout=float(timeout), init_timeout=float(init_timeout),
                    buffer_bytes=buffer_bytes, keep=keep)
    if set_default:
        if _default is not None and not _default.closed:
            _default.finalize()
        _default = comm
    return comm


def _join_shm(client, prefix, rank, size, timeout, init_timeout, buffer_bytes, oversubscribed):
    """The native shared-memory communicator of `size` ranks that rendezvous under `prefix`."""
    key = f"{prefix}/segment"
    if rank == 0:
        try:
            _shm.sweep_stale()
            info = _comm.new_segment_info(size, buffer_bytes)
            seg = _comm.create_segment(info)
        except Exception as e:
            # The other ranks wait for the segment's name: tell them why none is coming.
            client.set(key, json.dumps({"error": str(e), "kind": type(e).__name__}).encode())
            raise
        client.set(key, json.dumps(info).encode())
    else:
        info = json.loads(client.get(key, timeout=init_timeout))
        if "error" in info:
            cls = getattr(_errors, info["kind"], PlaitError)
            cls = cls if isinstance(cls, type) and issubclass(cls, PlaitError) else PlaitError
            raise cls(f"rank {rank}: rank 0 could not create the communicator: {info['error']}")
        seg = _comm.open_segment(info)
    native = _C.Communicator(seg, rank, float(timeout), os.environ.get("PLAIT_ALGO", ""),
                             oversubscribed, float(init_timeout))
    return native, info


def _init_in(client, prefix, rank, size, *, timeout, init_timeout, buffer_bytes, keep, ctx=None):
    """init's rendezvous under a key prefix: the flat communicator when every rank is on one host,
    else a hierarchical one (plait/_hier.py). `keep` is closed with the communicator."""
    try:
        # Every init of a job draws the next generation number, so a store can serve many inits.
        gen = (client.add(f"{prefix}/arrivals", 1) - 1) // size
        base = f"{prefix}/{gen}"
        ids = _hosts.exchange(client, base, rank, size, init_timeout) if size > 1 else None
        if ids is None or len({h for h, _ in ids}) == 1:
            native, info = _join_shm(client, base, rank, size, timeout, init_timeout, buffer_bytes,
                                     size > _comm._cpus())
            return Communicator(native, timeout=timeout, buffer_bytes=info["staging"], world_size=size,
                                keep=keep)

        def join_local(pfx, lrank, lsize, oversubscribed):
            native, info = _join_shm(client, pfx, lrank, lsize, timeout, init_timeout, buffer_bytes,
                                     oversubscribed)
            return Communicator(native, timeout=timeout, buffer_bytes=info["staging"], world_size=lsize)
        return _hier.create(client, base, rank, size, ids, timeout=timeout, init_timeout=init_timeout,
                            buffer_bytes=buffer_bytes, keep=keep, ctx=ctx, join_local=join_local)
    except BaseException:
        for k in keep:
            k.close()
        raise


_served = {}  # (host, port) -> the StoreServer rank 0 keeps for later inits


def _serve_for_good(host, port):
    """Rank 0's store at MASTER_PORT + 1, served from its first init until the process exits. Peers
    find it at a fixed address, so they may start their next init (and connect) before rank 0 has
    finalized the previous one: a store closed with the communicator would drop them then."""
    server = _served.get((host, port))
    if server is None or server.closed:
        server = _served[(host, port)] = _store.StoreServer(host, port)
    return server


def _mpirun_store(rank):
    """Under mpirun with no store named: (host, port, bind address) of a store rank 0 serves on a
    free port, its address broadcast with mpi4py. None when not under mpirun or a store is named."""
    if "OMPI_COMM_WORLD_SIZE" not in os.environ or os.environ.get("PLAIT_STORE") or \
            os.environ.get("MASTER_PORT"):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        raise InvalidArgument("plait under mpirun without PLAIT_STORE or MASTER_ADDR/MASTER_PORT needs "
                              "mpi4py to share the store's address (pip install mpi4py)") from None
    import socket
    addr = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        import contextlib
        with contextlib.closing(socket.socket()) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", 0) or 0) ==
            int(os.environ["OMPI_COMM_WORLD_SIZE"]) else socket.gethostname())
        addr = (host, port)
    host, port = MPI.COMM_WORLD.bcast(addr, root=0)
    return host, port, "0.0.0.0" if rank == 0 else False


def is_initialized():
    return _default is not None and not _default.closed


def get_default():
    if _default is None or _default.closed:
        raise PlaitError("plait is not initialized: call plait.init() first")
    return _default


def finalize():
    """Closes the default communicator (queued calls finish first)."""
    global _default
    if _default is not None:
        _default.finalize()
        _default = None


def dump(comm=None, path=None):
    """The flight recorder's report of `comm` (default: the default communicator): every rank's
    last calls read from shared memory, the dead or frozen ones included, as a dict; written as
    JSON to `path` when given."""
    return _flight.dump(get_default() if comm is None else comm, path)


def allreduce(x, out=None, **kw):
    return get_default().allreduce(x, out, **kw)


def reduce_scatter(x, out=None, **kw):
    return get_default().reduce_scatter(x, out, **kw)


def allgather(x, out=None, **kw):
    return get_default().allgather(x, out, **kw)


def broadcast(x, root=0, **kw):
    return get_default().broadcast(x, root, **kw)


def reduce(x, root=0, **kw):
    return get_default().reduce(x, root, **kw)


def alltoall(x, out=None, **kw):
    return get_default().alltoall(x, out, **kw)


def send(x, peer, **kw):
    return get_default().send(x, peer, **kw)


def recv(out, peer, **kw):
    return get_default().recv(out, peer, **kw)


def barrier(**kw):
    return get_default().barrier(**kw)


def split(color, key=0, **kw):
    return get_default().split(color, key, **kw)
