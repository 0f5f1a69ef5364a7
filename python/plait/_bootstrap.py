"""How a process joins a communicator: ranks from the launcher (plait-run, torchrun, mpirun), the
rendezvous store (named, launcher's, served by rank 0, or over MPI), the shared segment, and the
choice between the flat and the hierarchical communicator. `plait.init` is the public face of
`connect`; `split` and the hierarchical communicator come back here for their own rendezvous.
"""

import json
import os

from . import _C, _comm, _errors, _hier, _hosts, _shm, _store
from ._comm import Communicator
from ._errors import InvalidArgument, PlaitError


def _env_int(name):
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise InvalidArgument(f"{name}={v!r} is not an integer") from None


def connect(rank=None, size=None, *, store=None, timeout=None, buffer_bytes=None, init_timeout=None):
    """A new communicator (flat or hierarchical) of this process; arguments as plait.init's."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ:  # under mpirun: its ranks, unless a launcher set ours
        for ours, theirs in (
            ("RANK", "RANK"),
            ("WORLD_SIZE", "SIZE"),
            ("LOCAL_RANK", "LOCAL_RANK"),
            ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"),
        ):
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
    return init_in(
        client,
        "plait",
        rank,
        size,
        timeout=float(timeout),
        init_timeout=float(init_timeout),
        buffer_bytes=buffer_bytes,
        keep=keep,
    )


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
    native = _C.Communicator(
        seg, rank, float(timeout), os.environ.get("PLAIT_ALGO", ""), oversubscribed, float(init_timeout)
    )
    return native, info


def init_in(client, prefix, rank, size, *, timeout, init_timeout, buffer_bytes, keep, ctx=None):
    """init's rendezvous under a key prefix: the flat communicator when every rank is on one host,
    else a hierarchical one (plait/_hier.py). `keep` is closed with the communicator."""
    try:
        # Every init of a job draws the next generation number, so a store can serve many inits.
        gen = (client.add(f"{prefix}/arrivals", 1) - 1) // size
        base = f"{prefix}/{gen}"
        ids = _hosts.exchange(client, base, rank, size, init_timeout) if size > 1 else None
        if ids is None or len({h for h, _ in ids}) == 1:
            native, info = _join_shm(
                client, base, rank, size, timeout, init_timeout, buffer_bytes, size > _comm._cpus()
            )
            return Communicator(
                native, timeout=timeout, buffer_bytes=info["staging"], world_size=size, keep=keep
            )

        def join_local(pfx, lrank, lsize, oversubscribed):
            native, info = _join_shm(
                client, pfx, lrank, lsize, timeout, init_timeout, buffer_bytes, oversubscribed
            )
            return Communicator(native, timeout=timeout, buffer_bytes=info["staging"], world_size=lsize)

        return _hier.create(
            client,
            base,
            rank,
            size,
            ids,
            timeout=timeout,
            init_timeout=init_timeout,
            buffer_bytes=buffer_bytes,
            keep=keep,
            ctx=dict(ctx or {}, init_in=init_in),
            join_local=join_local,
        )
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
    if (
        "OMPI_COMM_WORLD_SIZE" not in os.environ
        or os.environ.get("PLAIT_STORE")
        or os.environ.get("MASTER_PORT")
    ):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        raise InvalidArgument(
            "plait under mpirun without PLAIT_STORE or MASTER_ADDR/MASTER_PORT needs "
            "mpi4py to share the store's address (pip install mpi4py)"
        ) from None
    import socket

    addr = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        import contextlib

        with contextlib.closing(socket.socket()) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1"
            if int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", 0) or 0)
            == int(os.environ["OMPI_COMM_WORLD_SIZE"])
            else socket.gethostname()
        )
        addr = (host, port)
    host, port = MPI.COMM_WORLD.bcast(addr, root=0)
    return host, port, "0.0.0.0" if rank == 0 else False
