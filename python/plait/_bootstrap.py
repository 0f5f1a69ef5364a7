"""How a process joins a communicator: ranks from the launcher (plait-run, torchrun, mpirun), the
rendezvous store (named, launcher's, served by rank 0, or over MPI), the shared segment, and the
choice between the flat and the hierarchical communicator. `plait.init` is the public face of
`connect`; `split` and the hierarchical communicator come back here for their own rendezvous.
"""

import json
import os

from . import _C, _comm, _errors, _hier, _hosts, _shm, _store, _watch
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


_LAUNCH_HINT = "start N ranks with `plait-run -n N train.py` (or torchrun --nproc-per-node N train.py)"


def _world(rank, size):
    """(rank, size) from the arguments, else RANK / WORLD_SIZE; with neither, a world of one (as
    mpi4py's singleton init and Horovod's): `python train.py` just runs."""
    env_rank, env_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    rank = env_rank if rank is None else int(rank)
    size = env_size if size is None else int(size)
    if rank is None and size in (None, 1):
        return 0, 1
    if rank is None or size is None:
        have = f"RANK={rank}" if size is None else f"WORLD_SIZE={size}"
        want = "WORLD_SIZE (or size=)" if size is None else "RANK (or rank=)"
        raise InvalidArgument(
            f"plait.init: {have} but no {want}: a launcher sets both; {_LAUNCH_HINT}, "
            "or call plait.init() with neither for a one-process world"
        )
    return rank, size


class _LocalStore:
    """The rendezvous store of a one-process world: nothing to meet, so a dict in this process."""

    def __init__(self):
        self._kv, self._counters = {}, {}

    def add(self, key, n):
        self._counters[key] = self._counters.get(key, 0) + n
        return self._counters[key]

    def set(self, key, value):
        self._kv[key] = value

    def get(self, key, timeout=None):
        if key not in self._kv:
            raise PlaitError(f"one-process world: nothing will ever set {key!r}")
        return self._kv[key]

    def check(self, keys):
        keys = [keys] if isinstance(keys, str) else keys
        return all(k in self._kv or k in self._counters for k in keys)

    def wait(self, keys, timeout=None):
        keys = [keys] if isinstance(keys, str) else keys
        missing = [k for k in keys if k not in self._kv and k not in self._counters]
        if missing:
            raise PlaitError(f"one-process world: nothing will ever set {missing!r}")

    def close(self):
        pass


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
    rank, size = _world(rank, size)
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgument(f"rank {rank} is not in a world of {size}")
    # Checked before the rendezvous, so a rank never waits in it on a value it then refuses; a
    # rank that refuses one still joins, to tell the others why (init_in raises it there).
    bad = None
    try:
        timeout, init_timeout = _timeouts(timeout, init_timeout)
        check_env()
    except InvalidArgument as e:
        bad, timeout, init_timeout = e, 0.0, 60.0  # only to reach the store and say why
    keep = []
    if store is None and size == 1:
        store = _LocalStore()  # a world of one needs no rendezvous, so no address either
    if isinstance(store, _store.Store) or all(hasattr(store, m) for m in ("add", "set", "get")):
        client = store  # plait's client, or an adapter (the torch backend wraps torch's store)
    else:
        if store is None:
            mpirun = _mpirun_store(rank)
            host, port, serve = mpirun or _store.store_from_env(rank)
            if mpirun and serve:  # a fresh port per init, announced over MPI: it ends with the communicator
                keep.append(_store.StoreServer(serve, port, token=os.environ.get(_store.TOKEN_ENV)))
            elif serve:
                _serve_for_good(host, port)
        else:
            host, port = store
        try:
            client = _store.Store(host, port, timeout=init_timeout)
        except BaseException:
            _comm.close_all(keep)
            raise
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
        refused=bad,
    )


def _timeouts(timeout, init_timeout):
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
    return timeout, init_timeout


# Settings read after the rendezvous (by the native communicator, the GPU queue, the reduction
# kernels): each value is checked here, before any rank waits on this one. A switch is on unless
# it is "0", so a stray "off" or "false" would silently mean on: only 0 and 1 are taken.
_SWITCHES = ("PLAIT_FLIGHT", "PLAIT_SINGLE_COPY", "PLAIT_HIER_CHECK", "PLAIT_HIER_FRAME_ADAPT")
_CHOICES = {
    "PLAIT_INTER": ("gloo", "mpi"),
    "PLAIT_GPU_TRANSPORT": ("auto", "nccl", "ipc"),
    "PLAIT_REDUCE_ISA": ("avx512", "avx2", "portable"),
}
_POSITIVE = {
    "PLAIT_BUFFER_BYTES": "a positive integer number of bytes",
    "PLAIT_GPU_CHUNK_BYTES": "a positive integer number of bytes",
    "PLAIT_GPU_IPC_BYTES": "a positive integer number of bytes",
    "PLAIT_GPU_WATCHDOG_MS": "a positive integer number of milliseconds",
}


def check_env():
    """Every PLAIT_* setting a communicator reads, checked before any rank waits on this one."""
    _C.check_env()
    env = os.environ
    for name in _SWITCHES:
        if env.get(name, "1") not in ("0", "1"):
            raise InvalidArgument(f"{name}={env[name]!r}: set it to 0 (off) or 1 (on)")
    for name, choices in _CHOICES.items():
        text = env.get(name, "").strip().lower()
        if text and text not in choices:
            raise InvalidArgument(f"{name}={env[name]!r}: choose one of {', '.join(choices)}")
    for name, what in _POSITIVE.items():
        text = env.get(name)
        if text is not None and not (text.strip().isdigit() and int(text) > 0):
            raise InvalidArgument(f"{name}={text!r} is not {what}")
    text = env.get("PLAIT_FLIGHT_SIZE")
    if text is not None and env.get("PLAIT_FLIGHT", "1") != "0":
        if not (text.isdigit() and 1 <= int(text) <= 1 << 16):
            raise InvalidArgument(f"PLAIT_FLIGHT_SIZE={text!r} is not a number of records in 1..65536")


def _claim(client, prefix, rank):
    """Refuses a second live process that joins as `rank` (a stray plait.init against a running
    job): each process that joins as rank r claims it in turn, and the latest live claim other
    than this process's own wins over this one. Runs before the arrival count, so a refused
    process leaves the job's rendezvous as it was."""
    me = _watch.identity()
    n = client.add(f"{prefix}/claims/{rank}", 1)
    mine = f"{prefix}/claim/{rank}/{n}"
    client.set(mine, me.encode())
    for k in range(n - 1, 0, -1):
        try:
            other = client.get(f"{prefix}/claim/{rank}/{k}", timeout=5.0).decode(errors="replace")
        except _errors.TimeoutError:
            continue  # a claimant that died between its two steps
        if other in (me, "refused"):
            if other == me:
                return
            continue
        try:
            ident = _watch.parse_identity(other, f"claim {k} of rank {rank}")
        except InvalidArgument:
            continue
        if _watch.gone(ident):
            return
        client.set(mine, b"refused")
        where = "this host" if _watch.local_pid(ident) else f"machine {ident[0]}"
        raise InvalidArgument(
            f"rank {rank} is already taken in this job by pid {ident[2]} on {where} (two processes "
            f"joined the rendezvous under {prefix!r} as rank {rank}; check RANK, or the rank passed "
            "to plait.init)"
        )


def _join_shm(client, prefix, rank, size, timeout, init_timeout, buffer_bytes, oversubscribed, watch=None):
    """The native shared-memory communicator of `size` ranks that rendezvous under `prefix`."""
    key = f"{prefix}/segment"
    get = watch.get if watch is not None else (lambda k, timeout: client.get(k, timeout=timeout))
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
        info = _segment_info(get(key, timeout=init_timeout), rank, size)
        if "error" in info:
            cls = getattr(_errors, str(info.get("kind")), PlaitError)
            cls = cls if isinstance(cls, type) and issubclass(cls, PlaitError) else PlaitError
            raise cls(f"rank {rank}: rank 0 could not create the communicator: {info['error']}")
        seg = _comm.open_segment(info)
    native = _C.Communicator(
        seg,
        rank,
        float(timeout),
        os.environ.get("PLAIT_ALGO", ""),
        oversubscribed,
        float(init_timeout),
        peer_pids=watch.pids() if watch is not None else [],
    )
    return native, info


def _segment_info(blob, rank, size):
    """The segment description rank 0 published, checked field by field before it is used."""
    try:
        info = json.loads(blob)
    except ValueError:
        info = None
    if isinstance(info, dict) and "error" in info:
        return info
    ints = ("size", "staging", "pair_slot")
    if (
        not isinstance(info, dict)
        or not isinstance(info.get("name"), str)
        or not info["name"].startswith("/" + _shm.SEGMENT_PREFIX)
        or not all(isinstance(info.get(k), int) and info[k] > 0 for k in ints)
        or info["size"] != size
        or not isinstance(info.get("token"), list)
        or len(info["token"]) != 2
        or not all(isinstance(t, int) and 0 <= t < 1 << 64 for t in info["token"])
        or not isinstance(info.get("flight", 0), int)
    ):
        raise InvalidArgument(
            f"rank {rank}: the segment record in the rendezvous is malformed: {bytes(blob)[:120]!r}"
        )
    return info


def init_in(client, prefix, rank, size, *, timeout, init_timeout, buffer_bytes, keep, ctx=None, refused=None):
    """init's rendezvous under a key prefix: the flat communicator when every rank is on one host,
    else a hierarchical one (plait/_hier.py). `keep` is closed with the communicator. `refused`: an
    error this rank raises once it has joined, so the others raise it too instead of waiting."""
    base = watch = None
    try:
        if size > 1:
            _claim(client, prefix, rank)
        # A store serves many inits: rank r's k-th init joins generation k. Counted per rank, so a
        # rank that refuses an init (and tells the others) cannot run ahead into the next
        # generation's slots, and a stray count elsewhere disturbs nobody.
        gen = client.add(f"{prefix}/arrivals/{rank}", 1) - 1
        base = f"{prefix}/{gen}"
        if refused is not None:
            raise refused
        watch = _watch.Watch(client, base, rank, size, init_timeout) if size > 1 else None
        ids = _hosts.exchange(client, base, rank, size, init_timeout, watch) if size > 1 else None
        if ids is None or len({h for h, _ in ids}) == 1:
            native, info = _join_shm(
                client, base, rank, size, timeout, init_timeout, buffer_bytes, size > _comm._cpus(), watch
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
    except BaseException as e:
        cause = None
        if base is not None and size > 1:
            cause = _watch.published(client, base, rank)
            if cause is None or getattr(e, "_plait_published", False):
                cause = None
                _watch.publish(client, base, rank, e)
            _shm.sweep_stale()  # a segment a dead peer made and never handed over
        _comm.close_all(keep)
        if cause is not None:
            raise cause from e  # a peer's failure is why this rank's wait or open failed
        raise


_served = {}  # (host, port) -> the StoreServer rank 0 keeps for later inits


def _serve_for_good(host, port):
    """Rank 0's store at MASTER_PORT + 1, served from its first init until the process exits. Peers
    find it at a fixed address, so they may start their next init (and connect) before rank 0 has
    finalized the previous one: a store closed with the communicator would drop them then."""
    server = _served.get((host, port))
    if server is None or server.closed:
        server = _served[(host, port)] = _store.StoreServer(
            host, port, token=os.environ.get(_store.TOKEN_ENV)
        )
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
    bind = "127.0.0.1" if host == "127.0.0.1" else "0.0.0.0"  # a one-host job stays on loopback
    return host, port, bind if rank == 0 else False
