"""plait.horovod's grouped allreduce layout kept across calls (common/_fusion.py): repeated groups
stay exact, a tensor whose storage or shape changed is seen, strided tensors and dtypes numpy lacks
take the slow path, autograd sees the in-place write, and group shape mismatches still fail. Each
runs on the native copies (csrc/torch/horovod.cc) and on the numpy path (PLAIT_HOROVOD_NATIVE=0,
what a machine that cannot build plait's torch module gets)."""

import pytest

torch = pytest.importorskip("torch")

try:  # a group's native path compiles plait's torch module once: here, not in a rank's deadline
    from plait.torch import _native

    _native.load()
except ImportError:  # NativeBuildError: the groups take numpy's path
    pass


def _hvd():
    import plait.horovod.torch as hvd

    hvd.init()
    return hvd


def _settle(cond, within=5.0):
    import time

    end = time.monotonic() + within
    while not cond():
        assert time.monotonic() < end, "layouts of freed tensors were not dropped"
        time.sleep(0.01)


def _repeat(rank, n, _addr):
    hvd = _hvd()
    from plait.horovod.common import _fusion

    tri = n * (n - 1) // 2
    f32 = [torch.zeros(4) for _ in range(20)] + [torch.zeros(2, 3)]
    i64 = [torch.zeros(3, dtype=torch.int64) for _ in range(5)]
    bf = [torch.zeros(2, dtype=torch.bfloat16) for _ in range(3)]  # numpy has no bfloat16
    group = f32 + i64 + bf
    for step in range(4):
        for i, t in enumerate(group):
            t.fill_(i % 4 * 2 + step + rank)  # small: bfloat16 is exact to 256
        out = hvd.grouped_allreduce_(group, op=hvd.Sum, name="rep")
        assert out is not None
        for i, t in enumerate(group):
            assert t.flatten().tolist() == [n * (i % 4 * 2 + step) + tri] * t.numel(), (step, i)
    assert len(_fusion._cache) == 1  # one layout, reused by steps 1-3
    # out of place, same tensors: fresh results, inputs untouched, the layout reused
    outs = hvd.grouped_allreduce(group, op=hvd.Sum, name="oop")
    for i, (t, o) in enumerate(zip(group, outs)):
        assert o.shape == t.shape and o.dtype == t.dtype
        assert o.flatten().tolist() == [n * n * (i % 4 * 2 + 3) + n * tri] * t.numel()
        assert t.flatten().tolist() == [n * (i % 4 * 2 + 3) + tri] * t.numel()
        assert o.data_ptr() != t.data_ptr()
    assert len(_fusion._cache) == 1
    # integer Average truncates, through the cached layout too
    ints = [torch.full((2,), 2 * rank + 1, dtype=torch.int32) for _ in range(3)]
    for _ in range(2):
        for t in ints:
            t.fill_(2 * rank + 1)
        hvd.grouped_allreduce_(ints, op=hvd.Average, name="avg")
        assert [t.tolist() for t in ints] == [[(n * n) // n] * 2] * 3
    # new tensors every step (gradients set to None): the freed ones' layouts go with them
    before = len(_fusion._cache)
    for step in range(5):
        fresh = [torch.full((3,), float(step + rank)) for _ in range(4)]
        hvd.grouped_allreduce_(fresh, op=hvd.Sum, name="fresh")
        assert [t.tolist() for t in fresh] == [[n * step + tri] * 3] * 4
    # only the last step's tensors are alive (the coordinator's thread may hold the last op a
    # moment longer, while it finishes the cycle that completed it)
    _settle(lambda: len(_fusion._cache) == before + 1)
    del fresh
    _settle(lambda: len(_fusion._cache) == before)
    used = _fusion.native() is not None
    hvd.shutdown()
    assert not _fusion._cache  # shutdown drops the layouts (they hold fusion buffer views)
    return used


NATIVE = [pytest.param("1", id="native"), pytest.param("0", id="numpy")]


@pytest.mark.parametrize("native", NATIVE)
def test_repeated_group_is_exact(ranks, native):
    env = {"PLAIT_HOROVOD_NATIVE": native}
    assert ranks(_repeat, 2, env=env, timeout=90) == [native == "1"] * 2
    assert ranks(_repeat, 3, env=env, timeout=120) == [native == "1"] * 3


def _changed(rank, n, _addr):
    hvd = _hvd()
    a, b, c = torch.ones(3), torch.ones(4), torch.ones(2)
    group = [a, b, c]
    hvd.grouped_allreduce_(group, op=hvd.Sum, name="g")
    assert [t.tolist() for t in group] == [[n] * 3, [n] * 4, [n] * 2]
    # new storage behind the same tensor object
    b.data = torch.full((4,), float(rank))
    hvd.grouped_allreduce_(group, op=hvd.Sum, name="g")
    assert b.tolist() == [n * (n - 1) / 2] * 4 and a.tolist() == [n * n] * 3
    # same storage, new shape
    a.resize_(2)
    a.fill_(1)
    hvd.grouped_allreduce_(group, op=hvd.Sum, name="g")
    assert a.tolist() == [n] * 2 and c.tolist() == [n**3] * 2
    # a strided member: contiguous copies travel and are copied back
    m = torch.arange(6, dtype=torch.float32).view(2, 3) + rank
    t = m.t()
    hvd.grouped_allreduce_([t, c], op=hvd.Sum, name="s")
    tri = n * (n - 1) // 2
    assert m.tolist() == [[n * v + tri for v in range(3)], [n * v + tri for v in range(3, 6)]]
    # autograd sees the in-place write (version bump): backward through a saved tensor fails
    w = torch.ones(3, requires_grad=True)
    x = torch.ones(3)
    y = (w * x).sum()
    v0 = x._version
    hvd.grouped_allreduce_([x, c], op=hvd.Sum, name="v")
    hvd.grouped_allreduce_([x, c], op=hvd.Sum, name="v")  # the second one through the layout
    assert x._version >= v0 + 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # the same first tensor and length with another member (a fresh list each call): the layout
    # found by the first tensor is checked against every member, so q is not taken for p
    tri = n * (n - 1) // 2
    h = torch.full((2,), float(rank))
    p, q = torch.full((3,), float(rank)), torch.full((3,), float(2 * rank))
    hvd.grouped_allreduce_([h, p], op=hvd.Sum, name="h1")
    hvd.grouped_allreduce_([h, q], op=hvd.Sum, name="h2")
    hvd.grouped_allreduce_([h, p], op=hvd.Sum, name="h1")  # h1's layout again, by its first tensor
    assert q.tolist() == [2 * tri] * 3 and p.tolist() == [n * tri] * 3, (p, q)
    assert h.tolist() == [n * n * tri] * 2, h
    # ranks that disagree on a group's shapes fail on every rank, and the next op works
    bad = [torch.ones(2 if rank == 0 else 3), torch.ones(3 if rank == 0 else 2)]  # equal totals
    with pytest.raises(hvd.HorovodInternalError, match=r"group tensor shapes.*\[\[2\],\[3\]\]"):
        hvd.grouped_allreduce_(bad, op=hvd.Sum, name="bad")
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [n]
    hvd.shutdown()


@pytest.mark.parametrize("native", NATIVE)
def test_changed_tensors_are_seen(ranks, native):
    ranks(_changed, 2, env={"PLAIT_HOROVOD_NATIVE": native}, timeout=90)


def _scaled(rank, n, _addr):
    """Scale factors and Average on a repeated group: folded into the native copies, or passes of
    their own on the numpy path; the same results either way (Horovod's ScaleBuffer: integers
    truncate)."""
    hvd = _hvd()
    tri = n * (n - 1) // 2
    f32 = [torch.zeros(k + 1) for k in range(6)]
    f64 = [torch.zeros(3, 2, dtype=torch.float64) for _ in range(3)]
    f16 = [torch.zeros(5, dtype=torch.float16) for _ in range(2)]
    i32 = [torch.zeros(4, dtype=torch.int32) for _ in range(3)]
    for step in range(3):  # the first call makes the layouts, the next ones reuse them
        for g in (f32, f64, f16, i32):
            for i, t in enumerate(g):
                t.fill_(4 * (i + step + rank))
        hvd.grouped_allreduce_(f32, op=hvd.Sum, prescale_factor=0.5, postscale_factor=0.25, name="f32")
        for i, t in enumerate(f32):
            assert t.tolist() == [(n * (i + step) + tri) / 2] * (i + 1), (step, i, t)
        hvd.grouped_allreduce_(f64 + f16, op=hvd.Average, name="mixed")  # two dtypes: two parts
        for i, t in enumerate(f64):
            assert t.flatten().tolist() == [4 * (i + step) + 4 * tri / n] * 6, (step, i)
        for i, t in enumerate(f16):
            assert t.tolist() == [4 * (i + step) + 4 * tri / n] * 5, (step, i)
        hvd.grouped_allreduce_(i32, op=hvd.Sum, prescale_factor=0.3, postscale_factor=1.5, name="i32")
        for i, t in enumerate(i32):
            s = sum(int(4 * (i + step + r) * 0.3) for r in range(n))  # each rank's truncated
            assert t.tolist() == [int(s * 1.5)] * 4, (step, i, t)
        outs = hvd.grouped_allreduce(f32, op=hvd.Average, name="oop")  # out of place
        for t, o in zip(f32, outs):
            assert o.tolist() == t.tolist() and o.data_ptr() != t.data_ptr()
    hvd.shutdown()


@pytest.mark.parametrize("native", NATIVE)
def test_group_scale_factors(ranks, native):
    ranks(_scaled, 2, env={"PLAIT_HOROVOD_NATIVE": native}, timeout=90)
    ranks(_scaled, 3, env={"PLAIT_HOROVOD_NATIVE": native}, timeout=120)


def test_native_copies_check_what_they_touch():
    """The native copies refuse, with the tensor and sizes named, what would write out of bounds."""
    from plait.horovod.common import _fusion

    nat = _fusion.native()
    if nat is None:
        pytest.skip("plait's native torch module cannot be built here")
    ts = [torch.arange(3, dtype=torch.float32), torch.tensor([[0.0, 1.0]])]
    grp = nat._HvdGroup(ts)
    out = torch.zeros(5)
    grp.gather(out, 2.0)
    assert out.tolist() == [0, 2, 4, 0, 2]
    v = ts[1]._version
    grp.scatter(torch.arange(10, 15, dtype=torch.float32), 0.5)
    assert ts[0].tolist() == [5, 5.5, 6] and ts[1].tolist() == [[6.5, 7]]
    assert ts[1]._version > v
    got = torch.zeros(2, dtype=torch.int64)
    nat._HvdGroup([torch.tensor([7, -7], dtype=torch.int64)]).gather(got, 0.5)
    assert got.tolist() == [3, -3]  # truncated toward zero, as Horovod's ScaleBuffer
    with pytest.raises(ValueError, match=r"hold 20 bytes, the fusion span 24"):
        grp.gather(torch.zeros(6), 1.0)
    a = nat._hvd_meta(ts)
    ts[1].resize_(3)  # changed after the layout was made: lookup sees it (a new layout is built)
    ts[1].fill_(9)
    assert nat._hvd_meta(ts) != a
    grp.scatter(torch.arange(20, 25, dtype=torch.float32), 1.0)  # the old group stays in bounds
    assert ts[1].tolist() == [23, 24, 9]
    with pytest.raises(ValueError, match=r"tensor 1 of the group \(Double, 2 elements"):
        nat._HvdGroup([ts[0], torch.zeros(2, dtype=torch.float64)]).scatter(out, 1.0)
    with pytest.raises(ValueError, match=r"tensor 0 of the group .*contiguous"):
        nat._HvdGroup([torch.zeros(2, 3).t()]).gather(torch.zeros(6), 1.0)
    a = nat._hvd_meta(ts)  # the layout check: address, dtype, device, shape, contiguity
    assert a == nat._hvd_meta(list(ts)) and a != nat._hvd_meta([ts[0], ts[1].view(1, 3)])
    sq = torch.zeros(3, 3)
    assert a != nat._hvd_meta([ts[0], ts[1].double()]) and nat._hvd_meta([sq]) != nat._hvd_meta([sq.t()])
    # each step's check compares in place: the same answers as comparing _hvd_meta's bytes
    assert nat._hvd_same(ts, a) and nat._hvd_same(tuple(ts), a)
    for other in ([ts[0], ts[1].view(1, 3)], [ts[0], ts[1].double()], [ts[0]], ts + [sq], [ts[0], 3]):
        assert not nat._hvd_same(other, a), other
    assert nat._hvd_same([sq.t()], nat._hvd_meta([sq.t()])) and not nat._hvd_same(
        [sq], nat._hvd_meta([sq.t()])
    )
    assert nat._hvd_same([], nat._hvd_meta([]))


def _one_thread():
    # A rank forked from a pytest process whose torch already ran parallel kernels would hang in
    # its first parallel kernel (OpenMP's pool does not survive fork); plait-run's ranks get
    # OMP_NUM_THREADS=1 anyway. The large tensors here are the first to reach that grain size.
    torch.set_num_threads(1)


def _large(rank, n, _addr):
    _one_thread()
    hvd = _hvd()
    base = torch.arange(16, dtype=torch.float32).repeat(1 << 14)  # 1 MiB: in place, not fused
    x = base + rank
    tri = n * (n - 1) / 2
    y = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert torch.equal(y, (n * base + tri) / 2) and torch.equal(x, base + rank)
    z = (base * 2 + 2 * rank).to(torch.float16)  # 512 KiB of halves, exact integers
    hvd.allreduce_(z, op=hvd.Average)
    assert torch.equal(z, (base * 2 + (n - 1)).to(torch.float16))
    v = (base + rank) * 2  # Average of float32 with no scale factors: a sum, then 1 / n
    hvd.allreduce_(v, op=hvd.Average)
    assert torch.equal(v, base * 2 + (n - 1))
    u = base.to(torch.int32) * 4 + rank  # an integer Average truncates, as Horovod's does
    hvd.allreduce_(u, op=hvd.Average)
    assert torch.equal(u, ((base.to(torch.int32) * 4 * n + n * (n - 1) // 2).double() / n).trunc().int())
    w = (base + rank).to(torch.float64)[::2]  # strided: a contiguous copy travels
    got = hvd.allreduce(w, op=hvd.Max)
    assert torch.equal(got, (base + n - 1).to(torch.float64)[::2])
    hvd.shutdown()


def test_large_tensor_in_place(ranks):
    ranks(_large, 2, timeout=90)
    ranks(_large, 3, timeout=120)


def _large_over_threshold(rank, n, _addr):
    _one_thread()
    hvd = _hvd()
    from plait.horovod.common import basics

    x = torch.arange(1 << 17, dtype=torch.float32) + rank  # 512 KiB, over the 300 KiB threshold
    hvd.allreduce_(x, op=hvd.Average)
    assert torch.equal(x, torch.arange(1 << 17, dtype=torch.float32) + (n - 1) / 2)
    fusion = basics.controller().executor._fusion
    size = 0 if fusion is None else fusion.numel()
    hvd.shutdown()
    return size


def test_large_tensor_over_threshold_skips_fusion_buffer(ranks):
    # the fusion buffer never grows past HOROVOD_FUSION_THRESHOLD for one tensor
    sizes = ranks(_large_over_threshold, 2, env={"HOROVOD_FUSION_THRESHOLD": str(300 << 10)}, timeout=90)
    assert all(s < 300 << 10 for s in sizes), sizes


def _cached(rank, n, _addr):
    """Horovod's response cache: a name every rank submitted alike travels as its slot number."""
    hvd = _hvd()
    from plait.horovod.common import basics

    ctrl = basics.controller()
    sent = []
    exchange = ctrl._exchange

    def spy(msg):
        sent.append({k: list(v) if k in ("r", "c") else v for k, v in msg.items()})
        return exchange(msg)

    fast = ctrl._fast_cycle

    def spy_fast(o, slot, plan):  # the native cycle sends the slot's frame itself
        sent.append({"r": [], "c": [slot]})
        return fast(o, slot, plan)

    ctrl._exchange, ctrl._fast_cycle = spy, spy_fast
    tri = n * (n - 1) // 2
    for step in range(3):
        x = torch.full((5,), float(rank + step))
        hvd.allreduce_(x, op=hvd.Sum, name="w")
        assert x.tolist() == [n * step + tri] * 5
    g = [torch.full((k + 1,), float(rank)) for k in range(4)]
    for step in range(3):
        for t in g:
            t.fill_(rank + step)
        hvd.grouped_allreduce_(g, op=hvd.Sum, name="g")
        assert [t.tolist() for t in g] == [[n * step + tri] * (k + 1) for k in range(4)]
    mine = [m for m in sent if m.get("r") or m.get("c")]
    full = [r[1] for m in mine for r in m["r"]]
    cached = [s for m in mine for s in m.get("c", ())]
    # each name went out in full once, then as its slot (capacity 0: always in full)
    want_full = (
        ["allreduce.w", "allreduce.g"] if ctrl.cache_capacity else ["allreduce.w"] * 3 + ["allreduce.g"] * 3
    )
    assert full == want_full, full
    assert cached == ([0, 0, 1, 1] if ctrl.cache_capacity else []), cached
    # a cached name with a new shape on one rank only: a mismatch on every rank, then it works
    with pytest.raises(hvd.HorovodInternalError, match=r"Mismatched allreduce shapes.*'allreduce.w'"):
        hvd.allreduce(torch.ones(6 if rank == 0 else 5), name="w")
    assert hvd.allreduce(torch.ones(5), op=hvd.Sum, name="w").tolist() == [n] * 5
    # and on every rank: the slot now holds the new request
    assert hvd.allreduce(torch.ones(7), op=hvd.Sum, name="w").tolist() == [n] * 7
    assert hvd.allreduce(torch.ones(7), op=hvd.Sum, name="w").tolist() == [n] * 7
    last = [m for m in sent if m.get("r") or m.get("c")][-1]
    if ctrl.cache_capacity:
        assert last.get("c") == [0] and not last["r"], last
    else:
        assert [r[1] for r in last["r"]] == ["allreduce.w"] and not last.get("c"), last
    # a rank that changes the op of a cached name is told apart too
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched allreduce reduction ops"):
        hvd.allreduce(torch.ones(7), op=hvd.Sum if rank else hvd.Max, name="w")
    hvd.shutdown()
    return len(ctrl._slots)


def test_response_cache(ranks):
    assert ranks(_cached, 2, timeout=90) == [2, 2]
    assert ranks(_cached, 3, timeout=90) == [2, 2, 2]
    assert ranks(_cached, 2, env={"HOROVOD_CACHE_CAPACITY": "0"}, timeout=90) == [0, 0]


def _autotune_log(rank, n, _addr, path):
    hvd = _hvd()
    hvd.shutdown()
    with open(path) as f:
        return f.read().splitlines()


def test_autotune_log_says_what_plait_keeps(ranks, tmp_path):
    head = ",".join(
        ("hierarchical_allreduce", "hierarchical_allgather", "cache_enabled", "cycle_time_ms")
        + ("tensor_fusion_threshold", "score")
    )
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_CYCLE_TIME": "2.5", "HOROVOD_FUSION_THRESHOLD": str(64 << 20)}
    log = str(tmp_path / "a.csv")
    assert ranks(_autotune_log, 1, args=(log,), env=dict(env, HOROVOD_AUTOTUNE_LOG=log)) == [
        [head, "0,0,1,2.5,64,0"]
    ]
    env.update(HOROVOD_AUTOTUNE_LOG=log, HOROVOD_CACHE_CAPACITY="0")
    assert ranks(_autotune_log, 1, args=(log,), env=env) == [[head, "0,0,0,2.5,64,0"]]


def test_native_module_loads_only_at_the_first_group():
    """Scripts that never group never load (nor compile) plait's native torch module."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "import plait.horovod.torch as hvd\n"
        "hvd.init()\n"
        "x = torch.ones(3)\n"
        "hvd.allreduce_(x, op=hvd.Sum)\n"
        "print('plait.torch' in sys.modules)\n"
        "hvd.grouped_allreduce_([x, torch.ones(2)], op=hvd.Sum)\n"
        "from plait.horovod.common import _fusion\n"
        "print(_fusion.native() is not None and 'plait.torch' in sys.modules)\n"
        "hvd.shutdown()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == "False", out.stdout
    from plait.horovod.common import _fusion

    assert lines[1] == str(_fusion.native() is not None), out.stdout


def _unbuildable(rank, n, _addr):
    import sys

    # As where plait.torch cannot compile its module (NativeBuildError is an ImportError):
    # plait.horovod takes its numpy path, with the same results.
    sys.modules["plait.torch"] = None
    hvd = _hvd()
    from plait.horovod.common import _fusion

    g = [torch.full((k + 1,), float(rank + 1)) for k in range(5)]
    for _ in range(2):
        hvd.grouped_allreduce_(g, op=hvd.Sum, postscale_factor=2.0, name="nb")
    tri = n * (n + 1) // 2
    assert [t.tolist() for t in g] == [[2 * (n * 2 * tri)] * (k + 1) for k in range(5)]
    used = _fusion.native()
    hvd.shutdown()
    return used is None


def test_group_without_native_module(ranks):
    assert ranks(_unbuildable, 2, timeout=90) == [True, True]
