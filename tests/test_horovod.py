"""plait.horovod.torch: every collective with closed-form results at 1-4 ranks, Horovod's
semantics (name matching in any order, mismatch then a good op, join, int Average truncation),
fusion, process sets, autograd, timeline, stall warning and deadline."""

import io
import json
import math
import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")

try:  # a group's native path compiles plait's torch module once: here, not in a rank's deadline
    from plait.torch import _native

    _native.load()
except ImportError:  # NativeBuildError: the groups take numpy's path
    pass

NO_LAUNCHER = {"RANK": None, "WORLD_SIZE": None, "PLAIT_STORE": None}


def _hvd():
    import plait.horovod.torch as hvd

    hvd.init()
    return hvd


def _collectives(rank, n, _addr):
    hvd = _hvd()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (rank, n, rank, n)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    tri = n * (n - 1) // 2
    x = torch.arange(6, dtype=torch.float32) + rank
    assert hvd.allreduce(x, op=hvd.Sum).tolist() == [n * i + tri for i in range(6)]
    assert x.tolist() == [i + rank for i in range(6)]  # input untouched
    # Average of integers truncates toward zero, as Horovod's postscale does.
    ints = torch.tensor([1, -1, 7, -7], dtype=torch.int32) * (rank + 1)
    s = (n * (n + 1)) // 2
    want = [math.trunc(v * s / n) for v in (1, -1, 7, -7)]
    assert hvd.allreduce(ints, op=hvd.Average).tolist() == want
    assert hvd.allreduce(x, op=hvd.Min).tolist() == list(range(6))
    assert hvd.allreduce(x, op=hvd.Max).tolist() == [i + n - 1 for i in range(6)]
    p = torch.full((3,), 2, dtype=torch.int64) + rank
    assert hvd.allreduce(p, op=hvd.Product).tolist() == [math.prod(range(2, 2 + n))] * 3
    scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert scaled.tolist() == [n * i + tri for i in range(6)]
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Average) is y
    assert y.tolist() == [i + (n - 1) / 2 for i in range(6)]
    with pytest.raises(ValueError):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(x, op=hvd.Adasum)
    with pytest.raises(TypeError, match="int16"):  # refused on the calling rank, before negotiation
        hvd.allreduce(torch.ones(2, dtype=torch.int16))
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(torch.ones(n), splits=[n + 1] + [0] * (n - 1))
    # allgather: uneven first dimension, rank r sends r+1 rows of r
    g = hvd.allgather(torch.full((rank + 1, 2), rank, dtype=torch.int64))
    assert g.tolist() == [[r, r] for r in range(n) for _ in range(r + 1)]
    gs = hvd.grouped_allgather([torch.tensor([rank]), torch.ones(rank + 1, 1)])
    assert gs[0].tolist() == list(range(n)) and gs[1].shape == (sum(range(1, n + 1)), 1)
    b = torch.arange(4) * (rank + 1)
    root = n - 1
    assert hvd.broadcast(b, root).tolist() == [i * n for i in range(4)]
    assert hvd.broadcast_(b, root) is b and b.tolist() == [i * n for i in range(4)]
    # alltoall with splits: rank r sends j+1 rows to rank j, rows valued 100*r + j
    splits = [j + 1 for j in range(n)]
    send = torch.cat([torch.full((j + 1,), 100 * rank + j) for j in range(n)])
    out, recv = hvd.alltoall(send, splits=splits)
    assert recv.tolist() == [rank + 1] * n
    assert out.tolist() == [100 * j + rank for j in range(n) for _ in range(rank + 1)]
    even = hvd.alltoall(torch.arange(2 * n) + 1000 * rank)
    assert even.tolist() == [1000 * j + 2 * rank + k for j in range(n) for k in range(2)]
    # reducescatter: 2n+1 rows; the lower ranks take the extra row
    rows = 2 * n + 1
    rs = hvd.reducescatter(torch.arange(rows, dtype=torch.float32).view(rows, 1) + rank, op=hvd.Sum)
    counts = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
    start, mine = sum(counts[:rank]), counts[rank]
    assert rs.view(-1).tolist() == [n * (start + i) + tri for i in range(mine)]
    avg = hvd.reducescatter(torch.full((n, 2), float(rank)))
    assert avg.tolist() == [[(n - 1) / 2] * 2]
    grs = hvd.grouped_reducescatter([torch.ones(n), torch.ones(n, 3)], op=hvd.Sum)
    assert grs[0].tolist() == [n] and grs[1].tolist() == [[n] * 3]
    # grouped allreduce: all four forms
    a, c = torch.ones(3) * rank, torch.arange(2, dtype=torch.float64)
    assert [t.tolist() for t in hvd.grouped_allreduce([a, c], op=hvd.Sum)] == [[tri] * 3, [0, n]]
    hs = hvd.grouped_allreduce_async([a, c], op=hvd.Sum)
    assert [t.tolist() for t in hvd.synchronize(hs)] == [[tri] * 3, [0, n]]
    hvd.grouped_allreduce_([a, c], op=hvd.Sum)
    assert a.tolist() == [tri] * 3 and c.tolist() == [0, n]
    h = hvd.grouped_allreduce_async_([a], op=hvd.Max)
    assert hvd.synchronize(h)[0] is a
    # async forms, poll, synchronize
    h1 = hvd.allreduce_async(torch.ones(4), op=hvd.Sum, name="a1")
    h2 = hvd.allgather_async(torch.tensor([rank]), name="a2")
    h3 = hvd.broadcast_async(torch.tensor([rank]), 0, name="a3")
    h4 = hvd.alltoall_async(torch.arange(n) + 10 * rank, name="a4")
    h5 = hvd.reducescatter_async(torch.ones(n), name="a5", op=hvd.Sum)
    z = torch.zeros(2)
    h6 = hvd.allreduce_async_(z + rank, name="a6")
    h7 = hvd.broadcast_async_(z, 0, name="a7")
    assert hvd.synchronize(h7).tolist() == [0, 0]
    assert hvd.synchronize(h1).tolist() == [n] * 4
    assert hvd.synchronize(h2).tolist() == list(range(n))
    assert hvd.synchronize(h3).tolist() == [0]
    assert hvd.synchronize(h4)[0].tolist() == [10 * j + rank for j in range(n)]
    assert hvd.synchronize(h5).tolist() == [n]
    while not hvd.poll(h6):
        time.sleep(0.001)
    assert hvd.synchronize(h6).tolist() == [(n - 1) / 2] * 2
    for dt in (
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int64,
        torch.bool,
    ):
        v = torch.ones(5, dtype=dt)
        want = [True] * 5 if dt == torch.bool else [n] * 5
        assert hvd.allreduce(v, op=hvd.Sum).tolist() == want, dt
    hvd.barrier()
    hvd.shutdown()
    assert not hvd.is_initialized()
    return True


@pytest.mark.parametrize("n", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_collectives(ranks, n):
    ranks(_collectives, n, timeout=120 if n < 4 else 180)


def _size_one(rank, n, _addr):
    import plait.horovod.torch as hvd

    assert "RANK" not in os.environ and "PLAIT_STORE" not in os.environ
    hvd.init()
    hvd.init()  # a second init while initialised does nothing
    assert (hvd.rank(), hvd.size(), hvd.local_size(), hvd.cross_size()) == (0, 1, 1, 1)
    assert hvd.allreduce(torch.arange(3.0)).tolist() == [0, 1, 2]
    assert hvd.join() == 0
    assert not hvd.mpi_built() and not hvd.mpi_enabled() and hvd.gloo_enabled() and hvd.gloo_built()
    assert isinstance(hvd.nccl_built(), int) and not hvd.rocm_built() and not hvd.ddl_built()
    hvd.shutdown()
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.rank()
    hvd.init()  # and again after shutdown
    assert hvd.size() == 1
    hvd.shutdown()
    return True


def test_size_one_without_launcher(ranks):
    ranks(_size_one, 1, env=NO_LAUNCHER)


def _any_order(rank, n, _addr):
    hvd = _hvd()
    one = torch.ones(2)
    if rank == 0:
        h = hvd.allreduce_async(one, name="x", op=hvd.Sum)
        hvd.barrier()
        hy = hvd.allreduce_async(one * 2, name="y", op=hvd.Sum)
    else:
        hy = hvd.allreduce_async(one * 2, name="y", op=hvd.Sum)
        hvd.barrier()
        h = hvd.allreduce_async(one, name="x", op=hvd.Sum)
    assert hvd.synchronize(h).tolist() == [n, n]
    assert hvd.synchronize(hy).tolist() == [2 * n, 2 * n]
    # names in reverse submission order across ranks
    names = [f"t{i}" for i in range(5)]
    order = names if rank % 2 == 0 else names[::-1]
    hs = {k: hvd.allgather_async(torch.tensor([int(k[1:]) * 10 + rank]), name=k) for k in order}
    for k in names:
        assert hvd.synchronize(hs[k]).tolist() == [int(k[1:]) * 10 + r for r in range(n)]
    hvd.shutdown()
    hvd.init()  # a new world after shutdown, as elastic training does
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [n]
    hvd.shutdown()
    return True


@pytest.mark.parametrize("n", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_any_order(ranks, n):
    ranks(_any_order, n, timeout=90)


def _mismatch(rank, n, _addr):
    hvd = _hvd()
    HIE = hvd.HorovodInternalError
    assert issubclass(HIE, RuntimeError)
    cases = [
        lambda: hvd.allreduce(torch.ones(2 + rank), name="shape"),
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if rank else torch.float64), name="dtype"),
        lambda: hvd.allreduce(torch.ones(2), name="op", op=hvd.Sum if rank else hvd.Max),
        lambda: hvd.broadcast(torch.ones(2), rank, name="root"),
        lambda: hvd.allgather(torch.ones(1, 2 + rank), name="gather"),
        lambda: hvd.alltoall(torch.ones(n, 1 + rank), name="a2a"),
    ]
    what = ["shapes", "data types", "reduction ops", "root ranks", "shapes", "shapes"]
    for case, word in zip(cases, what):
        with pytest.raises(HIE) as e:
            case()
        assert word in str(e.value) and f"rank {rank}:" in str(e.value), str(e.value)
        # and hvd is usable at once
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [n]
    hvd.shutdown()
    return True


@pytest.mark.parametrize("n", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_mismatch_then_good_op(ranks, n):
    ranks(_mismatch, n, timeout=90)


def _join(rank, n, _addr):
    hvd = _hvd()
    last = n - 1
    if rank != last:
        got = hvd.join()
    else:
        # The others have joined (or will): they contribute zeros / identities / no rows.
        one = torch.ones(3)
        assert hvd.allreduce(one, op=hvd.Sum, name="j1").tolist() == [1] * 3
        assert hvd.allreduce(one, op=hvd.Average, name="j2").tolist() == torch.full((3,), 1 / n).tolist()
        assert hvd.allreduce(one * 5, op=hvd.Min, name="j3").tolist() == [5] * 3
        assert hvd.allreduce(one * 5, op=hvd.Max, name="j4").tolist() == [5] * 3
        assert hvd.allreduce(one * 5, op=hvd.Product, name="j5").tolist() == [5] * 3
        assert hvd.grouped_allreduce([one, one * 2], op=hvd.Sum, name="j6")[1].tolist() == [2] * 3
        assert hvd.allgather(torch.ones(2, 2), name="j7").tolist() == [[1, 1], [1, 1]]
        assert hvd.broadcast(torch.ones(2) * 7, last, name="j8").tolist() == [7, 7]
        rs = hvd.reducescatter(torch.ones(n, 2), op=hvd.Sum, name="j9")
        assert rs.tolist() == [[1, 1]]
        out, recv = hvd.alltoall(torch.arange(n), splits=[1] * n, name="j10")
        assert recv.tolist() == [0] * (n - 1) + [1] and out.tolist() == [n - 1]
        hvd.barrier()
        if n > 1:
            with pytest.raises(hvd.HorovodInternalError, match="joined"):
                hvd.broadcast(torch.ones(1), 0, name="j11")
        got = hvd.join()
    assert got == last, got
    # after everyone joined, back to normal
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [n]
    hvd.shutdown()
    return True


@pytest.mark.parametrize("n", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_join(ranks, n):
    ranks(_join, n, timeout=90)


def _fusion(rank, n, _addr):
    hvd = _hvd()
    from plait.horovod.common import basics

    ctrl = basics.controller()
    ex = ctrl.executor
    ts = [torch.full((10,), float(i + rank)) for i in range(100)]
    before = ex.calls
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum)
    grouped = ex.calls - before
    for i, o in enumerate(outs):
        assert o.tolist() == [n * i + n * (n - 1) // 2] * 10
    # mixed dtypes: one call per dtype
    before = ex.calls
    mixed = hvd.grouped_allreduce(
        [torch.ones(3), torch.ones(3, dtype=torch.float64), torch.ones(2)], op=hvd.Sum
    )
    assert [m.tolist() for m in mixed] == [[n] * 3, [n] * 3, [n] * 2]
    mixed_calls = ex.calls - before
    # 100 separate ops that become ready in one cycle (held back until all are queued) are
    # fused up to HOROVOD_FUSION_THRESHOLD
    before = ex.calls
    with ctrl._lock:
        hs = [hvd.allreduce_async(t, op=hvd.Sum, name=f"f{i}") for i, t in enumerate(ts)]
    for i, h in enumerate(hs):
        assert hvd.synchronize(h).tolist() == [n * i + n * (n - 1) // 2] * 10
    separate = ex.calls - before
    hvd.shutdown()
    return grouped, mixed_calls, separate


def test_fusion(ranks):
    assert ranks(_fusion, 2, timeout=90) == [(1, 2, 1)] * 2
    # 100 tensors of 40 bytes with a 400-byte threshold: 10 per fused call; a group is one call
    res = ranks(_fusion, 2, env={"HOROVOD_FUSION_THRESHOLD": "400"}, timeout=90)
    assert res == [(1, 2, 10)] * 2, res


def _process_sets(rank, n, _addr):
    import plait.horovod.torch as hvd

    evens = hvd.ProcessSet([r for r in range(n) if r % 2 == 0])
    single = hvd.ProcessSet([n - 1])
    hvd.init(process_sets=[evens, single])
    assert evens.process_set_id is not None and evens.size() == len(evens.ranks)
    assert evens.included() == (rank % 2 == 0) and single.rank() == (0 if rank == n - 1 else None)
    if rank % 2 == 0:
        out = hvd.allreduce(torch.tensor([rank]), op=hvd.Sum, process_set=evens)
        assert out.tolist() == [sum(evens.ranks)]
        assert hvd.allgather(torch.tensor([rank]), process_set=evens).tolist() == evens.ranks
        assert hvd.broadcast(torch.tensor([rank]), evens.ranks[-1], process_set=evens).tolist() == [
            evens.ranks[-1]
        ]
        hvd.barrier(process_set=evens)
    if rank == n - 1:
        assert hvd.allreduce(torch.tensor([5]), op=hvd.Sum, process_set=single).tolist() == [5]
    else:
        with pytest.raises(ValueError, match="not in"):
            hvd.allreduce(torch.tensor([5]), process_set=single)
    # dynamic: odds, added by every rank; concurrent ops on two sets and the world
    odds = hvd.add_process_set([r for r in range(n) if r % 2 == 1]) if n > 1 else None
    with pytest.raises(ValueError):
        hvd.add_process_set(evens.ranks)
    mine = evens if rank % 2 == 0 else odds
    h1 = hvd.allreduce_async(torch.tensor([rank]), op=hvd.Sum, process_set=mine, name="set")
    h2 = hvd.allreduce_async(torch.tensor([1]), op=hvd.Sum, name="world")
    assert hvd.synchronize(h2).tolist() == [n]
    assert hvd.synchronize(h1).tolist() == [sum(mine.ranks)]
    if odds is not None:
        assert hvd.remove_process_set(odds) and odds.process_set_id is None
        assert not hvd.remove_process_set(odds)
    assert not hvd.remove_process_set(hvd.global_process_set)
    hvd.shutdown()
    return True


@pytest.mark.parametrize("n", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_process_sets(ranks, n):
    ranks(_process_sets, n, timeout=120)


def _autograd(rank, n, _addr):
    hvd = _hvd()
    x = torch.arange(4, dtype=torch.float64, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * (rank + 1)).sum().backward()
    assert x.grad.tolist() == [n * (n + 1) / 2] * 4  # the sum of every rank's upstream gradient
    x.grad = None
    hvd.allreduce(x, op=hvd.Average).sum().backward()
    assert x.grad.tolist() == [1.0] * 4
    a = torch.ones(2, dtype=torch.float64, requires_grad=True)
    outs = hvd.grouped_allreduce([a, a * 2], op=hvd.Sum)
    (outs[0].sum() + outs[1].sum()).backward()
    assert a.grad.tolist() == [3.0 * n] * 2
    # allgather: the gradient of my rows, averaged over ranks
    g = torch.ones(rank + 1, 2, dtype=torch.float64, requires_grad=True)
    gathered = hvd.allgather(g)
    w = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(n)]).double()
    (gathered * w).sum().backward()
    assert g.grad.tolist() == [[float(rank)] * 2] * (rank + 1)
    gg = [torch.ones(1, dtype=torch.float64, requires_grad=True)]
    hvd.grouped_allgather(gg)[0].sum().backward()
    assert gg[0].grad.tolist() == [1.0]
    b = torch.ones(3, dtype=torch.float64, requires_grad=True)
    hvd.broadcast(b, 0).sum().backward()
    assert b.grad.tolist() == ([1.0] * 3 if rank == 0 else [0.0] * 3)
    t = torch.arange(n, dtype=torch.float64, requires_grad=True)
    out = hvd.alltoall(t)
    (out * (torch.arange(n) + 1)).sum().backward()
    assert t.grad.tolist() == [float(rank + 1)] * n
    r = torch.ones(n, 2, dtype=torch.float64, requires_grad=True)
    hvd.reducescatter(r, op=hvd.Sum).sum().backward()
    assert r.grad.tolist() == [[1.0, 1.0]] * n
    r.grad = None
    hvd.grouped_reducescatter([r], op=hvd.Average)[0].sum().backward()
    assert r.grad.tolist() == [[1.0 / n] * 2] * n
    hvd.shutdown()
    return True


@pytest.mark.parametrize("n", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_autograd(ranks, n):
    ranks(_autograd, n, timeout=90)


def _timeline(rank, n, _addr, path):
    hvd = _hvd()
    hvd.allreduce(torch.ones(4), name="tl.a")
    hvd.allgather(torch.ones(1), name="tl.b")
    if rank == 0:
        with open(path) as f:
            json.load(f)  # valid JSON while running
    hvd.broadcast(torch.ones(1), 0, name="tl.c")
    hvd.grouped_allreduce([torch.ones(2), torch.ones(2)], name="tl.d")
    hvd.start_timeline(path + ".2")  # switches files at run time (rank 0 writes)
    hvd.allreduce(torch.ones(1), name="tl.e")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(1), name="tl.f")
    hvd.shutdown()
    if rank == 0:
        with open(path + ".2") as f:
            events = json.load(f)
        names = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name"}
        # tl.f may show its negotiation starting (rank 1 can submit it before rank 0 stops the
        # timeline, as in Horovod), but never its operation: rank 0 submits it only after stopping.
        assert "allreduce.tl.e" in names and set(names) <= {"allreduce.tl.e", "allreduce.tl.f"}, names
        pid_f = names.get("allreduce.tl.f")
        assert not [e for e in events if e.get("pid") == pid_f and e.get("name") == "ALLREDUCE"], events
    return True


def test_timeline(ranks, tmp_path):
    path = str(tmp_path / "timeline.json")
    ranks(_timeline, 2, args=(path,), env={"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    with open(path) as f:
        events = json.load(f)
    names = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name"}
    assert {"allreduce.tl.a", "allgather.tl.b", "broadcast.tl.c", "allreduce.tl.d"} <= set(names)

    def seq(tensor):
        pid = names[tensor]
        return [(e["ph"], e.get("name")) for e in events if e.get("pid") == pid and e["ph"] in "BEi"]

    a = seq("allreduce.tl.a")
    assert a[0] == ("B", "NEGOTIATE_ALLREDUCE") and ("i", "0") in a and ("i", "1") in a
    assert ("B", "ALLREDUCE") in a and a[-1][0] == "E"
    assert sum(1 for p, _ in a if p == "B") == sum(1 for p, _ in a if p == "E")
    assert ("B", "MEMCPY_IN_FUSION_BUFFER") in seq("allreduce.tl.d")
    assert ("B", "NEGOTIATE_ALLGATHER") in seq("allgather.tl.b") and ("B", "BROADCAST") in seq(
        "broadcast.tl.c"
    )
    assert any(e.get("name") == "CYCLE_START" for e in events)


def _stall(rank, n, _addr):
    err = io.StringIO()
    sys.stderr = err
    hvd = _hvd()
    if rank == 0:
        h = hvd.allreduce_async(torch.ones(1), name="late", op=hvd.Sum)
        assert hvd.synchronize(h).tolist() == [n]
    else:
        time.sleep(2.5)
        hvd.allreduce(torch.ones(1), name="late", op=hvd.Sum)
    # the deadline: rank 1 never submits 'lonely'
    if rank == 0:
        with pytest.raises(hvd.HorovodInternalError) as e:
            hvd.allreduce(torch.ones(1), name="lonely")
        msg = str(e.value)
        assert "allreduce.lonely" in msg and "rank(s) [1]" in msg, msg
    else:
        time.sleep(2)  # so that its barrier does not reach the deadline too
    hvd.barrier()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [n]
    hvd.shutdown()
    sys.stderr = sys.__stderr__
    return err.getvalue()


def test_stall_warning_and_deadline(ranks):
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "4"}
    out = ranks(_stall, 2, env=env, timeout=90)
    assert "stall" in out[0] and "1: [allreduce.late]" in out[0], out[0]
    assert "1: [allreduce.lonely]" in out[0]
    assert out[1] == ""


def _shutdown_peer(rank, n, _addr):
    hvd = _hvd()
    hvd.allreduce(torch.ones(1))
    if rank == 1:
        hvd.shutdown()
        return "left"
    with pytest.raises(hvd.HorovodInternalError, match="shut down"):
        hvd.allreduce(torch.ones(1), name="after")
    hvd.shutdown()
    return "raised"


def test_peer_shutdown_fails_pending_ops(ranks):
    assert ranks(_shutdown_peer, 2, timeout=60) == ["raised", "left"]


HOROVOD_TORCH_API = """init shutdown is_initialized start_timeline stop_timeline size local_size
cross_size rank
local_rank cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built
ddl_built ccl_built cuda_built rocm_built is_homogeneous Average Sum Adasum Min Max Product allreduce
allreduce_ allreduce_async allreduce_async_ grouped_allreduce grouped_allreduce_ grouped_allreduce_async
grouped_allreduce_async_ sparse_allreduce_async allgather allgather_async grouped_allgather
grouped_allgather_async broadcast broadcast_ broadcast_async broadcast_async_ alltoall alltoall_async
reducescatter reducescatter_async grouped_reducescatter grouped_reducescatter_async join barrier poll
synchronize ProcessSet global_process_set add_process_set remove_process_set Compression
DistributedOptimizer broadcast_parameters broadcast_optimizer_state broadcast_object allgather_object
SyncBatchNorm elastic HorovodInternalError HostsUpdatedInterrupt""".split()


def test_module_tree_and_api():
    import importlib

    import plait.horovod.torch as hvd

    missing = [n for n in HOROVOD_TORCH_API if not hasattr(hvd, n)]
    assert not missing
    for mod in (
        "plait.horovod.torch.mpi_ops",
        "plait.horovod.torch.functions",
        "plait.horovod.torch.optimizer",
        "plait.horovod.torch.compression",
        "plait.horovod.torch.sync_batch_norm",
        "plait.horovod.torch.elastic",
        "plait.horovod.torch.elastic.state",
        "plait.horovod.torch.elastic.sampler",
        "plait.horovod.common.util",
        "plait.horovod.common.exceptions",
        "plait.horovod.common.elastic",
        "plait.horovod.common.process_sets",
        "plait.horovod.common.basics",
    ):
        importlib.import_module(mod)
    for n in ("run", "TorchState", "ObjectState", "ElasticSampler", "State"):
        assert hasattr(hvd.elastic, n), n
    from plait.horovod.common import util
    from plait.horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

    assert issubclass(HorovodInternalError, RuntimeError) and HostsUpdatedInterrupt(True).skip_sync
    assert util.split_list(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert util.num_rank_is_power_2(8) and not util.num_rank_is_power_2(6)
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.size()


def _sampler_state(rank, n, _addr):
    hvd = _hvd()
    s = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    assert list(s) == list(range(rank, 10, n)) and len(s) == 5
    s.record_batch(0, 2)  # this rank's first two samples are done
    state = hvd.elastic.TorchState(sampler=s, epoch=3 + rank)
    state.sync()  # the union of what every rank processed; plain attributes from rank 0
    assert state.epoch == 3 and s.processed_indices == {0, 1, 2, 3}
    assert list(s) == [4 + rank, 6 + rank, 8 + rank]
    state.epoch = 9
    state.commit()
    state.epoch = 10
    state.restore()
    assert state.epoch == 9
    obj = hvd.elastic.ObjectState(step=rank)
    obj.sync()
    assert obj.step == 0
    hvd.shutdown()
    return True


def test_elastic_sampler_and_state(ranks):
    ranks(_sampler_state, 2, timeout=60)


def _killed_peer(rank, n, _addr):
    import signal

    hvd = _hvd()
    hvd.allreduce(torch.ones(1))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(hvd.HorovodInternalError) as e:
        hvd.allreduce(torch.ones(1), name="after")
    msg = str(e.value)
    assert "PeerLostError" in msg and "rank 1" in msg, msg
    assert isinstance(e.value.flight, dict) and e.value.flight, e.value.flight
    with pytest.raises(hvd.HorovodInternalError):  # the world is gone until shutdown() + init()
        hvd.allreduce(torch.ones(1), name="again")
    hvd.shutdown()
    return time.monotonic() - t0


def test_killed_peer_is_an_error_not_a_hang(ranks):
    took = ranks(_killed_peer, 2, may_die=(1,), timeout=60)[0]
    assert took < 30, took


def _killed_peer_seen_idle(rank, n, _addr):
    import signal

    hvd = _hvd()
    hvd.allreduce(torch.ones(1))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # the coordinator's idle cycles meet the dead peer before the next op
    with pytest.raises(hvd.HorovodInternalError) as e:
        hvd.allreduce(torch.ones(1), name="after")
    assert "PeerLostError" in str(e.value) and "rank 1" in str(e.value), str(e.value)
    assert isinstance(e.value.flight, dict) and e.value.flight, e.value.flight
    hvd.shutdown()


def test_killed_peer_seen_by_an_idle_cycle(ranks):
    ranks(_killed_peer_seen_idle, 2, may_die=(1,), timeout=60)
