"""init / shutdown / topology queries and the one coordinator of this process (Horovod's
HorovodBasics). The world is a plait communicator; see _controller.py for the coordinator."""

import atexit
import hashlib
import os
import socket
import sys

import numpy as np

from . import _controller, _device, _execute, _fusion, _rendezvous, _subworld, process_sets
from .exceptions import HorovodInternalError
from .process_sets import ProcessSet, Registry, global_process_set

_state = None


class _State:
    pass


class _LocalStore:
    """The store of a world of one (hvd.init() without a launcher): nothing to meet."""

    def __init__(self):
        self._d = {}

    def add(self, key, n):
        self._d[key] = int(self._d.get(key, 0)) + int(n)
        return self._d[key]

    def set(self, key, value):
        self._d[key] = value

    def get(self, key, timeout=None):
        return self._d[key]

    def close(self):
        pass


def _env_rank_size():
    for r, s in (
        ("HOROVOD_RANK", "HOROVOD_SIZE"),
        ("RANK", "WORLD_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ):
        if os.environ.get(r) is not None and os.environ.get(s) is not None:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


def _host_id():
    name = os.environ.get("HOROVOD_HOSTNAME") or os.environ.get("PLAIT_HOST_ID") or socket.gethostname()
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little", signed=True)


def init(comm=None, process_sets=None):
    """Joins the world of HOROVOD_RANK/HOROVOD_SIZE (plait-run), RANK/WORLD_SIZE (torchrun) or
    mpirun's ranks; a world of one without a launcher. Calling it again while initialised does
    nothing. comm: a list of the launcher's ranks or an mpi4py communicator: those processes (and
    only they call init) become the world, ranked in the list's (communicator's) order.
    process_sets: static ProcessSets to register now."""
    global _state
    if _state is not None:
        return
    import plait

    _fusion.clear()  # PLAIT_HOROVOD_NATIVE is read again (a forked process may have decided)
    world = None
    if _rendezvous.enabled():
        if comm is not None:
            raise ValueError("hvd.init(comm=...) does not combine with an elastic job (plait-run --min-np)")
        world, rank, size = _rendezvous.join(_controller.env_float("HOROVOD_ELASTIC_TIMEOUT", 600.0))
    else:
        rank, size = _env_rank_size()
    if comm is not None:
        ranks, mpi_comm = _subworld.members(comm, rank, size)
        if not _subworld.is_whole_world(ranks, size):
            world, rank, size = _subworld.connect(ranks, rank, mpi_comm)
    if world is None:
        store = _LocalStore() if size == 1 and not os.environ.get("PLAIT_STORE") else None
        world = plait.init(rank, size, store=store, set_default=False)
    try:
        world.label = "horovod"
    except Exception:  # noqa: BLE001 - a hierarchical communicator has no label
        pass
    st = _State()
    st.comm, st.rank, st.size = world, rank, size
    ids = world.allgather(np.array([_host_id()], dtype=np.int64)).reshape(-1) if size > 1 else [_host_id()]
    hosts = list(dict.fromkeys(int(h) for h in ids))
    me = int(ids[rank])
    st.local_rank = sum(1 for r in range(rank) if int(ids[r]) == me)
    st.local_size = sum(1 for h in ids if int(h) == me)
    local_ranks = [sum(1 for q in range(r) if int(ids[q]) == int(ids[r])) for r in range(size)]
    same_local = [r for r in range(size) if local_ranks[r] == st.local_rank]
    st.cross_rank, st.cross_size = same_local.index(rank), len(same_local)
    st.homogeneous = len({sum(1 for h in ids if int(h) == x) for x in hosts}) == 1
    st.registry = Registry(world, size)
    for ps in process_sets or ():
        if ps is global_process_set:
            continue
        _register_static(st, ps)
    st.counters = {}
    timeline = None
    path = os.environ.get("HOROVOD_TIMELINE")
    if path and rank == 0:
        from .timeline import Timeline

        timeline = Timeline(path, os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0") in ("1", "true"))
    st.controller = _controller.Controller(world, rank, size, st.registry, _execute.Executor(), timeline)
    _autotune_note(rank)
    _state = st


def _register_static(st, ps):
    bad = [r for r in ps.ranks if not 0 <= r < st.size]
    if bad or not ps.ranks:
        raise ValueError(f"process set {ps.ranks} has ranks outside the world of {st.size}")
    if st.registry.find(ps.ranks) is not None:
        raise ValueError(f"a process set with ranks {ps.ranks} is already registered")
    member = st.rank in ps.ranks
    sub = st.comm.split(0 if member else None, ps.ranks.index(st.rank) if member else 0)
    ps_id = st.registry.next_id
    st.registry.register(ps_id, ps.ranks, sub)
    ps.process_set_id = ps_id


def _autotune_note(rank):
    if os.environ.get("HOROVOD_AUTOTUNE", "0") not in ("1", "true"):
        return
    log = os.environ.get("HOROVOD_AUTOTUNE_LOG")
    chosen = (
        f"0,0,{int(_controller.env_float('HOROVOD_CACHE_CAPACITY', 1024) > 0)},"
        f"{_controller.env_float('HOROVOD_CYCLE_TIME', 1.0):g},"
        f"{_execute.fusion_threshold() / (1 << 20):g},0"
    )
    if log and rank == 0:
        with open(log, "w") as f:
            f.write(
                "hierarchical_allreduce,hierarchical_allgather,cache_enabled,cycle_time_ms,tensor_fusion_threshold,score\n"
            )
            f.write(chosen + "\n")
    if rank == 0:
        print(
            "[plait.horovod] HOROVOD_AUTOTUNE: plait picks its algorithms per call by size itself; "
            f"the coordinator keeps cycle time and fusion threshold as set ({chosen})",
            file=sys.stderr,
        )


def _st():
    if _state is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state


def shutdown():
    """Leaves: the other ranks' ops that this rank will not join fail with HorovodInternalError."""
    global _state
    st, _state = _state, None
    if st is None:
        return
    try:
        st.controller.shutdown()
    finally:
        _fusion.clear()  # layouts hold views of this world's fusion buffer
        _device.layer.clear()
        if st.controller.timeline is not None:
            st.controller.timeline.close()
        st.registry.close()
        try:
            st.comm.finalize()
        except Exception:  # noqa: BLE001 - a peer already gone: nothing left to say to it
            pass


atexit.register(shutdown)


def is_initialized():
    return _state is not None


def size():
    return _st().size


def rank():
    return _st().rank


def local_size():
    return _st().local_size


def local_rank():
    return _st().local_rank


def cross_size():
    return _st().cross_size


def cross_rank():
    return _st().cross_rank


def is_homogeneous():
    return _st().homogeneous


def controller():
    return _st().controller


def start_timeline(file_path, mark_cycles=False):
    """Starts writing the timeline to file_path (on rank 0; other ranks do nothing)."""
    st = _st()
    if st.rank != 0:
        return
    from .timeline import Timeline

    ctrl = st.controller
    old, ctrl.timeline = ctrl.timeline, Timeline(file_path, mark_cycles)
    if old is not None:
        old.close()


def stop_timeline():
    st = _st()
    tl, st.controller.timeline = st.controller.timeline, None
    if tl is not None:
        tl.close()


def next_name(kind, name, ps_id=0):
    """Horovod's op names: '<kind>.<name>', or '<kind>.noname.<n>' counting this kind's unnamed
    submissions (so unnamed ops match across ranks that submit them in the same order)."""
    st = _st()
    if name:
        return f"{kind}.{name}"
    n = st.counters.get(kind, 0) + 1
    st.counters[kind] = n
    return f"{kind}.noname.{n}"


def submit(ops, notify=True):
    _st().controller.submit(ops, notify)


def wait(ops):
    _st().controller.wait(ops)


def run(ops):
    """submit(ops) and wait(ops), for a synchronous call (no handle)."""
    _st().controller.run(ops)


def ps_members(process_set):
    st = _st()
    ps_id = 0 if process_set is None else process_set.process_set_id
    if ps_id is None or st.registry.get(ps_id) is None:
        raise ValueError(f"{process_set} is not registered (hvd.add_process_set, or init(process_sets=...))")
    ranks = st.registry[ps_id].ranks
    if st.rank not in ranks:
        raise ValueError(f"rank {st.rank} is not in {process_set}: only its members may submit ops on it")
    return ps_id, ranks


def _add_process_set(ps):
    st = _st()
    bad = [r for r in ps.ranks if not 0 <= r < st.size]
    if bad or not ps.ranks:
        raise ValueError(f"process set {ps.ranks} has ranks outside the world of {st.size}")
    if st.registry.find(ps.ranks) is not None or ps.ranks == list(range(st.size)):
        raise ValueError(f"a process set with ranks {ps.ranks} is already registered")
    n = st.counters.get("__ps__", 0) + 1
    st.counters["__ps__"] = n
    ps_id = st.registry.next_id
    op = _controller.Op(
        ["add_ps", f"process_set.add.{n}", 0, "uint8", ps.ranks, 0, ps_id, 1.0, 1.0, None], None
    )
    submit([op])
    wait([op])
    ps.process_set_id = op.result
    return ps


def _remove_process_set(ps):
    st = _st()
    if ps.process_set_id in (None, 0) or st.registry.get(ps.process_set_id) is None:
        return False
    n = st.counters.get("__ps__", 0) + 1
    st.counters["__ps__"] = n
    op = _controller.Op(
        ["rm_ps", f"process_set.remove.{n}", 0, "uint8", ps.ranks, 0, ps.process_set_id, 1.0, 1.0, None], None
    )
    submit([op])
    wait([op])
    ps._invalidate()
    return True


def mpi_threads_supported():
    return False


def mpi_enabled():
    return False


def mpi_built():
    return False


def gloo_enabled():
    return True  # a controller of plait's own, in the role of Horovod's gloo controller


def gloo_built():
    return True


def nccl_built():
    """NCCL's version code (e.g. 22105) when plait's build has the CUDA path and NCCL loads, else 0."""
    try:
        import plait

        info = plait.build_info()
        v = info.get("nccl")
        if not info.get("cuda") or not v:
            return 0
        parts = [int(p) for p in str(v).split(".")[:3]] + [0, 0, 0]
        return parts[0] * 10000 + parts[1] * 100 + parts[2]
    except Exception:  # noqa: BLE001
        return 0


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    try:
        import plait

        return bool(plait.build_info().get("cuda"))
    except Exception:  # noqa: BLE001
        return False


def rocm_built():
    return False


__all__ = [
    "HorovodInternalError",
    "ProcessSet",
    "global_process_set",
    "process_sets",
]
