"""Hierarchical collectives on simulated hosts (PLAIT_HOST_ID per rank) with gloo between them.

Each layout runs every collective, dtype and op in one run_ranks call and checks exact results
(hier_checks.py). torch is imported here, before run_ranks forks, so ranks do not each pay for it.
"""

import os
import re
import signal
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks
from plait import _hosts

import hier_checks as hc

torch = pytest.importorskip("torch")
import torch.distributed  # noqa: E402,F401,F811 - imported once in the parent, inherited by the forks

LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "3x1": ["a", "b", "c"],
    "2x2-interleaved": ["a", "b", "a", "b"],
    "uneven-2+1": ["a", "a", "b"],
}


def _init(rank, hosts, **kw):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    return plait.init(timeout=kw.pop("timeout", 30), **kw)


def test_layout_order_and_permutation():
    lay = _hosts.Layout(["b", "a", "b", "a"], rank=3)
    assert lay.hosts == [[0, 2], [1, 3]] and (lay.h, lay.i) == (1, 1) and lay.uniform
    assert lay.perm.tolist() == [0, 1, 2, 3]  # perm[i * H + h] = hosts[h][i]
    lay = _hosts.Layout(["x", "x", "y"], rank=2)
    assert not lay.uniform and lay.perm is None and (lay.h, lay.i) == (1, 0)


def _exact(rank, n, addr, hosts):
    comm = _init(rank, hosts, buffer_bytes=8192)  # small staging: the local steps run multi-chunk
    assert isinstance(comm, plait.HierCommunicator) and comm.engine == "gloo", repr(comm)
    checks = 0
    for count in (0, 1, 7):
        checks += hc.reductions(comm, count)
        checks += hc.movements(comm, count)
    # larger than one staging chunk, and not a multiple of the local size
    checks += hc.reductions(comm, 3001, dtypes=["float32", "bfloat16", "int8", "bool"], ops=["sum", "max"])
    checks += hc.reductions(comm, 3001, dtypes=["float16"], ops=["avg", "prod"])
    checks += hc.movements(comm, 3001, dtypes=["float32"])
    checks += hc.asynchronous(comm)
    comm.finalize()
    return checks


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_collective_dtype_and_op_is_exact(layout):
    hosts = LAYOUTS[layout]
    checks = run_ranks(_exact, len(hosts), timeout=120, args=(hosts,))
    assert len(set(checks)) == 1 and checks[0] > 700, checks


def _uneven(rank, n, addr, hosts):
    from plait import _hier

    comm = _init(rank, hosts, buffer_bytes=8192)
    checks = 0
    room = _hier._ROOM // 4  # float32 / int32 elements that still travel in the call's frame
    # 0, 1, primes, counts with every remainder modulo 3 ranks per host and 2 hosts, and both sides
    # of the frame's room (one call folded into the frame, the next with a header-only frame)
    for count in (0, 1, 2, 5, 13, room // 6, room // 6 + 1, room - 1, room, room + 1, room + 2, 1009):
        checks += hc.reductions(comm, count, dtypes=["int32", "float16"], ops=["sum", "max"])
        checks += hc.movements(comm, count, dtypes=["int32"])
    checks += hc.reductions(comm, 1009, dtypes=["bfloat16", "float32"], ops=["avg", "prod"])
    comm.finalize()
    return checks


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["2x3", "2x3-interleaved", "uneven-3+2"])
def test_counts_that_do_not_divide_by_ranks_per_host_or_hosts(layout):
    hosts = {
        "2x3": ["a", "a", "a", "b", "b", "b"],
        "2x3-interleaved": ["a", "b", "a", "b", "a", "b"],
        "uneven-3+2": ["a", "b", "a", "b", "a"],
    }[layout]
    checks = run_ranks(_uneven, len(hosts), timeout=240, args=(hosts,))
    assert checks == [292] * len(hosts), checks  # 12 counts x (16 reductions + 7 movements) + 16


def _torch_tensors(rank, n, addr, hosts):
    comm = _init(rank, hosts)
    t = torch.full((5,), float(rank + 1), dtype=torch.bfloat16)
    comm.allreduce(t, out=t, op="avg")
    g = comm.allgather(torch.tensor([rank], dtype=torch.int64))
    comm.finalize()
    return t.tolist(), g.tolist()


def test_torch_tensors_and_avg():
    hosts = LAYOUTS["2x2"]
    for t, g in run_ranks(_torch_tensors, 4, timeout=60, args=(hosts,)):
        assert t == [2.5] * 5 and g == [[0], [1], [2], [3]]


def _split(rank, n, addr, hosts):
    comm = _init(rank, hosts)
    by_host = comm.split(color=comm.layout.h, key=-rank)  # one host each: flat shm communicators
    across = comm.split(color=comm.layout.i)  # one rank per host: hierarchical
    none = comm.split(color=None)
    out = (
        type(by_host).__name__,
        by_host.rank,
        by_host.allreduce(np.array([rank]))[0],
        type(across).__name__,
        across.rank,
        across.allgather(np.array([rank])).ravel().tolist(),
        none,
    )
    for c in (by_host, across, comm):
        c.finalize()
    return out


def test_split_within_and_across_hosts():
    res = run_ranks(_split, 4, timeout=60, args=(LAYOUTS["2x2"],))
    assert res == [
        ("Communicator", 1, 1, "HierCommunicator", 0, [0, 2], None),
        ("Communicator", 0, 1, "HierCommunicator", 0, [1, 3], None),
        ("Communicator", 1, 5, "HierCommunicator", 1, [0, 2], None),
        ("Communicator", 0, 5, "HierCommunicator", 1, [1, 3], None),
    ]


def _one_host(rank, n, addr):
    os.environ.pop("PLAIT_HOST_ID", None)
    comm = plait.init(timeout=30)
    kind = type(comm).__name__
    comm.finalize()
    return kind


def test_one_host_stays_flat():
    assert run_ranks(_one_host, 3, timeout=60) == ["Communicator"] * 3


def _no_engine(rank, n, addr, hosts):
    from plait import _inter

    _inter._have = lambda mod: False  # as on a machine with neither torch nor mpi4py
    try:
        _init(rank, hosts)
    except plait.InvalidArgument as e:
        return str(e)
    return "no error"


def test_no_engine_is_a_clear_error_on_every_rank():
    for msg in run_ranks(_no_engine, 4, timeout=60, args=(LAYOUTS["2x2"],)):
        assert "span 2 hosts" in msg and "pip install torch" in msg and "mpi4py" in msg, msg


def _mpi_without_mpirun(rank, n, addr, hosts):
    os.environ["PLAIT_INTER"] = "mpi"
    try:
        _init(rank, hosts)
    except plait.InvalidArgument as e:
        return str(e)
    return "no error"


def test_forced_engine_that_is_missing():
    for msg in run_ranks(_mpi_without_mpirun, 3, timeout=60, args=(LAYOUTS["3x1"],)):
        assert "PLAIT_INTER=mpi needs mpi4py and a job started by mpirun" in msg, msg


def _killed(rank, n, addr, hosts, victim):
    comm = _init(rank, hosts, timeout=30)
    x = np.ones(1000, dtype=np.float32)
    for i in range(1000000):
        if rank == victim and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.allreduce(x, out=np.empty_like(x)) if i % 2 else comm.allgather(x)
        except (plait.PeerLostError, plait.TimeoutError) as e:
            return type(e).__name__, time.monotonic(), str(e)
    return "no error", time.monotonic(), ""


@pytest.mark.parametrize("layout,victim", [("2x2", 3), ("3x1", 1), ("2x2", 0)])
def test_rank_killed_on_one_host_raises_on_all_others(layout, victim):
    hosts = LAYOUTS[layout]
    start = time.monotonic()
    res = run_ranks(_killed, len(hosts), timeout=60, args=(hosts, victim), may_die=(victim,))
    for r, got in enumerate(res):
        if r == victim:
            assert got is None
            continue
        kind, when, msg = got
        assert kind in ("PeerLostError", "TimeoutError"), (r, kind, msg)
        assert when - start < 20, (r, when - start, msg)  # well inside the 30 s deadline


def _late(rank, n, addr, hosts):
    comm = _init(rank, hosts, timeout=2)
    comm.allreduce(np.ones(4))
    if rank == 3:
        time.sleep(4)  # past the others' deadline
    start = time.monotonic()
    try:
        comm.allreduce(np.ones(4))
    except plait.PlaitError as e:
        return type(e).__name__, time.monotonic() - start, str(e)
    return "no error", 0, ""


def test_late_rank_on_another_host_is_a_timeout():
    res = run_ranks(_late, 4, timeout=60, args=(LAYOUTS["2x2"],))
    for r, (kind, took, msg) in enumerate(res[:3]):
        assert kind in ("TimeoutError", "PeerLostError"), (r, kind, msg)
        assert took < 6, (r, took, msg)
    assert "TimeoutError" in [k for k, _, _ in res[:3]], res
    assert res[3][0] != "no error"  # the late rank finds the communicator aborted


def _bad_input(rank, n, addr, hosts):
    comm = _init(rank, hosts)
    x = np.ones(8, dtype=np.int32)
    start = time.monotonic()
    try:
        comm.allreduce(x, op="avg" if rank == 2 else "sum")
    except plait.PlaitError as e:
        return type(e).__name__, time.monotonic() - start, str(e)
    return "no error", 0, ""


def test_bad_input_on_one_host_raises_everywhere():
    res = run_ranks(_bad_input, 4, timeout=60, args=(LAYOUTS["2x2"],))
    assert res[2][0] == "InvalidArgument" and "avg needs a floating-point dtype" in res[2][2]
    for r in (0, 1, 3):
        kind, took, msg = res[r]
        assert kind == "InvalidArgument" and "rank 2" in msg and took < 10, (r, res[r])


def _mismatch(rank, n, addr, hosts, field):
    comm = _init(rank, hosts)
    odd = rank == n - 1  # the last rank, alone on its host in 3x1 and with a host peer in 2x2
    x = np.ones(8, dtype=np.float32)
    start = time.monotonic()
    try:
        if field == "count":
            comm.allreduce(x[:7] if odd else x)
        elif field == "op":
            comm.allreduce(x, op="max" if odd else "sum")
        elif field == "collective":
            if odd:
                comm.broadcast(x, root=0)
            else:
                comm.allreduce(x)
        elif field == "count-large":  # both past the frame's payload room: the header-only frame
            big = np.ones(3001, dtype=np.float32)
            comm.allreduce(big[:3000] if odd else big)
        elif field == "small-large":  # one rank's payload rides in the frame, the other's does not
            comm.allgather(np.ones(3001 if odd else 3, dtype=np.float32))
        elif field == "dtype":
            comm.reduce_scatter(np.ones(8 * n, dtype=np.int32 if odd else np.float32))
        elif field == "root":
            comm.broadcast(x, root=0 if odd else n - 1)
        elif field == "alltoall":
            comm.alltoall(np.ones(n * (5 if odd else 4), dtype=np.float32))
        else:  # a skipped call: the last rank goes straight to the second one
            if not odd:
                comm.allreduce(x)
            comm.allgather(x)
    except plait.PlaitError as e:
        return type(e).__name__, time.monotonic() - start, str(e)
    return "no error", 0, ""


@pytest.mark.parametrize(
    "layout,field",
    [
        ("3x1", "count"),
        ("2x2", "op"),
        ("3x1", "collective"),
        ("2x2-interleaved", "skip"),
        ("3x1", "count-large"),
        ("2x2", "small-large"),
        ("uneven-2+1", "dtype"),
        ("2x2", "root"),
        ("3x1", "alltoall"),
    ],
)
def test_mismatch_across_hosts_raises_on_every_rank(layout, field):
    hosts = LAYOUTS[layout]
    res = run_ranks(_mismatch, len(hosts), timeout=60, args=(hosts, field))
    for r, (kind, took, _msg) in enumerate(res):
        # The ranks that compared fingerprints raise MismatchError; their host peers learn of it
        # through the abort and raise the same class.
        assert kind == "MismatchError" and took < 10, (r, res)
    # Where the last rank shares its host (2x2), the call differs within that host too, and its
    # host peer may catch it first, in the host-local check ("mismatched calls: rank ..."), while
    # a large call's cross-host frame is still in flight.
    want = ("across hosts",) if hosts.count(hosts[-1]) == 1 else ("across hosts", "mismatched calls")
    assert any(w in msg for _, _, msg in res for w in want), res


def test_mismatch_names_rank_op_dtype_count_and_peer():
    # 3x1: every rank is in the one inter-host group and compares every frame; each raises its own
    # finding or, when another rank recorded its finding first, that one (the abort's first error)
    res = run_ranks(_mismatch, 3, timeout=60, args=(LAYOUTS["3x1"], "count"))
    call = "allreduce #1 (count {}, dtype float32, op sum, root -1)"
    for r, (kind, _, msg) in enumerate(res):
        assert kind == "MismatchError" and msg.startswith(f"rank {r}: "), msg
        found = re.search(r"rank (\d): mismatched calls across hosts: this rank \(host (\d)\) called", msg)
        assert found and found[1] == found[2], msg
        seen, peer = int(found[1]), re.search(r"but rank (\d) \(host (\d)\)", msg)
        assert peer and peer[1] == peer[2] and (seen == 2) != (int(peer[1]) == 2), msg
        assert call.format(7 if seen == 2 else 8) in msg and call.format(8 if seen == 2 else 7) in msg, msg
        assert msg.endswith("(they differ in count)"), msg


# -- GPU arrays: one flat NCCL communicator of all ranks (this machine has no GPU: the refusals) --
class _FakeCuda:
    """Claims to be a CUDA array (see test_cuda_cpu.FakeCuda); nothing is read through it."""

    def __init__(self, n=8):
        self.shape = (n,)
        self.__cuda_array_interface__ = {
            "data": (1 << 40, False),
            "shape": (n,),
            "typestr": "<f4",
            "strides": None,
            "version": 3,
            "stream": None,
        }


def _gpu_refused(rank, n, addr, hosts, case):
    if case == "ipc":
        os.environ["PLAIT_GPU_TRANSPORT"] = "ipc"
    comm = _init(rank, hosts)
    try:
        comm.barrier()  # every rank's engine groups are connected before any rank aborts them
        barrier_error = None
    except plait.PlaitError as e:
        # A barrier ends on each rank when all have arrived, not at once: a fast rank may fail its
        # GPU call (and abort the job) while a slow one is still leaving the barrier, which then
        # raises that failure, as any call in flight does.
        barrier_error = (type(e).__name__, 0.0, str(e))
    calls = {
        "allreduce": lambda: comm.allreduce(_FakeCuda(), out=_FakeCuda()),
        "allreduce_default_out": lambda: comm.allreduce(_FakeCuda()),
        "reduce_scatter": lambda: comm.reduce_scatter(_FakeCuda(8 * n), out=_FakeCuda()),
        "allgather_default_out": lambda: comm.allgather(_FakeCuda(), async_op=True),
        "ipc": lambda: comm.allreduce(_FakeCuda(), out=_FakeCuda()),
        "broadcast": lambda: comm.broadcast(_FakeCuda(), root=n - 1),
        "reduce": lambda: comm.reduce(_FakeCuda(), root=0, out=_FakeCuda()),
    }
    start = time.monotonic()
    try:
        if barrier_error is not None:
            got = barrier_error
        else:
            calls[case]()
            got = ("no error", 0.0, "")
    except plait.PlaitError as e:
        got = (type(e).__name__, time.monotonic() - start, str(e))
    try:  # the communicator is aborted now, on every rank, as after any error
        comm.allreduce(np.ones(4, np.float32))
        after = "no error"
    except plait.PlaitError as e:
        after = str(e)
    comm.finalize()
    os.environ.pop("PLAIT_GPU_TRANSPORT", None)
    fresh = _init(rank, hosts)
    total = fresh.allreduce(np.full(3, rank + 1, dtype=np.int64)).tolist()
    fresh.finalize()
    return got, after, type(fresh).__name__, total


@pytest.mark.parametrize(
    "layout,case,pattern",
    [
        ("2x2", "allreduce", None),
        ("uneven-2+1", "allreduce_default_out", None),
        ("3x1", "reduce_scatter", None),
        ("2x2-interleaved", "allgather_default_out", None),
        (
            "2x2",
            "ipc",
            r"PLAIT_GPU_TRANSPORT=ipc, but this communicator's ranks span 2 hosts and the CUDA IPC "
            r"transport reaches one host only",
        ),
        ("3x1", "broadcast", None),
        ("2x2", "reduce", None),
    ],
)
def test_gpu_arrays_take_the_gpu_path_and_are_refused_on_every_rank(layout, case, pattern):
    from plait import _cuda

    if pattern is None:
        if _cuda.compiled() and _cuda.device_count() > 0:
            pytest.skip("this machine has a CUDA device: tests/gpu/test_gpu_hier.py runs the GPU arrays")
        pattern = r"no CUDA device is visible" if _cuda.compiled() else r"no CUDA path"
    hosts = LAYOUTS[layout]
    res = run_ranks(_gpu_refused, len(hosts), timeout=90, args=(hosts, case))
    n = len(hosts)
    for r, ((kind, took, msg), after, fresh, total) in enumerate(res):
        # Every rank finds the problem (itself, or as the failure that ended the barrier it was
        # leaving): the same class and reason on every host, at once (the GPU path, not the numpy
        # conversion, saw the input).
        assert kind == "InvalidArgument" and re.search(pattern, msg), (r, kind, msg)
        assert msg.startswith(f"rank {r}: ") and "float32 x" in msg, (r, msg)
        assert took < 10, (r, took, msg)
        assert "aborted" in after, (r, after)
        assert fresh == "HierCommunicator" and total == [n * (n + 1) // 2] * 3, (r, fresh, total)


# -- the C API (csrc/bindings/capi.h) drives the C++ multi-host communicator as a flat one ------------
def _capi(rank, n, addr, hosts):
    from test_capi import ALLREDUCE, BROADCAST, _call, _host, _pointer, _table

    from plait import _C

    comm = _init(rank, hosts)
    t = _table()
    c = _pointer(_C._comm_capsule(comm._c), b"plait.Communicator")
    x = np.arange(1000, dtype=np.float32) * (rank + 1)  # past the frame's room: the staged steps
    y = np.empty_like(x)
    got = [(t.rank(c), t.size(c)), _call(t, c, ALLREDUCE, _host(x), _host(y))]
    b = np.full(3, rank, dtype=np.int64)
    got.append(_call(t, c, BROADCAST, _host(b), _host(b), root=n - 1))
    result = y.tolist()
    z = np.empty_like(x)
    bad_x, bad_y = _host(x), _host(z)
    if rank == 1:
        bad_x.dtype = bad_y.dtype = 99  # refused on rank 1: every host hears of it
    got.append(_call(t, c, ALLREDUCE, bad_x, bad_y)[0])
    comm.finalize()
    return got, result, b.tolist()


def test_c_api_drives_the_multi_host_communicator():
    from test_capi import E_INVALID

    hosts = LAYOUTS["2x2-interleaved"]
    for r, (got, y, b) in enumerate(run_ranks(_capi, 4, timeout=90, args=(hosts,))):
        assert got[:3] == [(r, 4), (0, ""), (0, "")], (r, got)
        assert got[3] == E_INVALID, (r, got)
        assert y == [10.0 * k for k in range(1000)] and b == [3] * 3, r
