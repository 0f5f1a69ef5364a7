"""The torch backend "plait" when its ranks span simulated hosts: gloo between them over torch's store."""

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import plait  # noqa: E402
import plait.torch  # noqa: E402
from test_torch_backend import init_pg, run_torch  # noqa: E402


def _assert_native(pg):
    """The group runs the C++ backend (a c10d Backend over _C.HierComm), with the native gloo
    engine between hosts (the facade takes it from the loaded native module)."""
    backend = pg._get_backend(torch.device("cpu"))
    assert type(backend) is torch._C._distributed_c10d.Backend and backend.name() == "plait", backend
    assert hasattr(plait.torch._native._module, "make_gloo_engine")


def _collectives(rank, n, store_dir, hosts):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    init_pg("plait", rank, n, store_dir, timeout=30)
    comm = plait.torch.communicator()
    assert isinstance(comm, plait.HierCommunicator) and comm.engine == "gloo", repr(comm)
    _assert_native(dist.group.WORLD)
    t = torch.arange(6, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    avg = torch.full((4,), float(rank), dtype=torch.bfloat16)
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    mx = torch.tensor([rank, -rank], dtype=torch.int64)
    w = dist.all_reduce(mx, op=dist.ReduceOp.MAX, async_op=True)
    w.wait()
    out = torch.empty(n * 2, dtype=torch.int32)
    dist.all_gather_into_tensor(out, torch.tensor([rank, 10 * rank], dtype=torch.int32))
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2 * n, dtype=torch.float32))
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=n - 1)
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    sub = dist.new_group([0, n - 1])  # spans hosts too
    s = torch.ones(2)
    if rank in (0, n - 1):
        dist.all_reduce(s, group=sub)
    dist.barrier()
    return (
        t.tolist(),
        avg.float().tolist(),
        mx.tolist(),
        out.tolist(),
        rs.tolist(),
        b.tolist(),
        [o["rank"] for o in objs],
        s.tolist(),
    )


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "c"]], ids=["2x2", "3x1"])
def test_torch_backend_across_hosts(tmp_path, hosts):
    n = len(hosts)
    tri = n * (n + 1) // 2
    for rank, got in enumerate(run_torch(_collectives, n, tmp_path, timeout=90, args=(hosts,))):
        t, avg, mx, out, rs, b, objs, s = got
        assert t == [tri * k for k in range(6)]
        assert avg == [(n - 1) / 2] * 4
        assert mx == [n - 1, 0]
        assert out == [v for r in range(n) for v in (r, 10 * r)]
        assert rs == [n * (2 * rank), n * (2 * rank + 1)]
        assert b == [float(n - 1)] * 3
        assert objs == list(range(n))
        assert s == ([2.0, 2.0] if rank in (0, n - 1) else [1.0, 1.0])


def _bad_input_on_one_host(rank, n, store_dir, hosts):
    import time

    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    init_pg("plait", rank, n, store_dir, timeout=20)
    # rank 0 passes a wrong number of outputs, which the backend rejects before any communication;
    # every other rank (on its host and on the others) makes the sound call and must not wait.
    outs = [torch.empty(2) for _ in range(n + 1 if rank == 0 else n)]
    t0 = time.monotonic()
    try:
        dist.all_gather(outs, torch.full((2,), float(rank)))
    except Exception as e:  # noqa: BLE001 - the class differs between the culprit and its peers
        kind = (
            "invalid"
            if isinstance(e, plait.InvalidArgument)
            else "plait"
            if isinstance(e, plait.PlaitError)
            else ""
        )
        return kind or type(e).__name__, str(e), time.monotonic() - t0
    return None, "", time.monotonic() - t0


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b"]], ids=["2x2", "2x1"])
def test_bad_input_on_one_rank_raises_on_every_rank_of_every_host(tmp_path, hosts):
    n = len(hosts)
    got = run_torch(_bad_input_on_one_host, n, tmp_path, timeout=90, args=(hosts,))
    for rank, (cls, msg, took) in enumerate(got):
        assert cls is not None, f"rank {rank} returned from a call rank 0 rejected"
        assert cls in ("invalid", "plait"), (rank, cls, msg)  # plait's classes, not a bare error
        assert "rank 0" in msg and "all_gather" in msg, (rank, cls, msg)
        assert took < 15, f"rank {rank} raised after {took:.1f} s, not promptly"
    assert got[0][0] == "invalid", got[0]


def _killed(rank, n, store_dir, hosts, victim):
    import signal
    import time

    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    init_pg("plait", rank, n, store_dir, timeout=60)
    t = torch.ones(1024)
    start = time.monotonic()
    for i in range(1_000_000):
        if i == 5 and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        if i == 5:
            start = time.monotonic()  # the victim dies about now
        try:
            dist.all_reduce(t) if i % 2 else dist.all_gather_into_tensor(torch.empty(n * 1024), t)
        except Exception as e:  # noqa: BLE001 - checked by the caller
            return type(e).__name__, isinstance(e, plait.PeerLostError), time.monotonic() - start, str(e)
    return None


@pytest.mark.parametrize("hosts,victim", [(["a", "a", "b", "b"], 3), (["a", "b"], 1)], ids=["2x2", "2x1"])
def test_rank_killed_on_one_host_is_peer_lost_everywhere(tmp_path, hosts, victim):
    n = len(hosts)
    store_dir = str(tmp_path)
    from conftest import run_ranks
    from test_torch_backend import _rank_main

    got = run_ranks(_rank_main, n, timeout=90, args=(_killed, (store_dir, hosts, victim)), may_die=(victim,))
    for rank, res in enumerate(got):
        if rank == victim:
            assert res is None
            continue
        assert res is not None, f"rank {rank} never noticed the dead rank"
        cls, lost, took, msg = res
        assert lost, (rank, cls, msg)  # a PeerLostError (torch's DistBackendError subclass of it)
        assert took < 10, f"rank {rank} raised after {took:.1f} s (deadline 60 s): {msg}"


def _native_features(rank, n, store_dir, hosts):
    """What the native backend has on one host, on a group across hosts: coalescing, split_group,
    sparse allreduce, allocateTensor (plait's shared memory), async works and futures."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    init_pg("plait", rank, n, store_dir, timeout=30)
    pg = dist.group.WORLD
    _assert_native(pg)
    tri = n * (n + 1) // 2
    # coalesced: two allreduces on rank 0 are one call, matching the others' single 5-element one
    c = torch.arange(5, dtype=torch.float32) * 10 * (rank + 1)
    if rank == 0:
        a, b = torch.arange(3, dtype=torch.float32), torch.arange(3, 5, dtype=torch.float32)
        with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
            dist.all_reduce(a, async_op=True)
            dist.all_reduce(b)
        cm.wait()
        fused = torch.cat([a, b]).tolist()
    else:
        dist.all_reduce(c)
        fused = c.tolist()
    # split_group: ranks 0 and n-1 (on different hosts), the parent goes on after
    sub = pg.split_group([0, n - 1], group_name="hier-sub")
    split = None
    if sub is not None:
        _assert_native(sub)
        t = torch.full((3,), float(rank + 1))
        sub.allreduce([t]).wait()
        split = t.tolist()
    # sparse: duplicate indices across ranks sum
    sp = torch.sparse_coo_tensor(torch.tensor([[rank, n]]), torch.tensor([1.0 + rank, 10.0]), (n + 1,))
    dist.all_reduce(sp)
    # allocateTensor: a tensor in plait's shared memory, reduced in place
    backend = pg._get_backend(torch.device("cpu"))
    shared = backend.allocate_tensor(3000, dtype=torch.float32, device=torch.device("cpu"))
    shared.copy_(torch.arange(3000, dtype=torch.float32) % 7 * (rank + 1))
    dist.all_reduce(shared)
    shared_ok = torch.equal(shared, torch.arange(3000, dtype=torch.float32) % 7 * tri)
    # an async call's future completes without wait(), and chains
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    doubled = fut.wait().tolist()
    dist.barrier()
    return fused, split, sp.to_dense().tolist(), shared_ok, doubled


@pytest.mark.parametrize("hosts", [["a", "b", "a"], ["a", "a", "b", "b"]], ids=["3-interleaved", "2x2"])
def test_native_features_across_hosts(tmp_path, hosts):
    n = len(hosts)
    tri = n * (n + 1) // 2
    for rank, (fused, split, dense, shared_ok, doubled) in enumerate(
        run_torch(_native_features, n, tmp_path, timeout=120, args=(hosts,))
    ):
        # rank 0's a + b = [0..4]; every other rank's c = 10 * (r + 1) * [0..4]
        assert fused == [k + 10 * k * (tri - 1) for k in range(5)], (rank, fused)
        assert split == ([float(1 + n)] * 3 if rank in (0, n - 1) else None), (rank, split)
        assert dense == [1.0 + r for r in range(n)] + [10.0 * n], (rank, dense)
        assert shared_ok and doubled == [2.0 * n] * 4, rank


def _any_source(rank, n, store_dir, hosts):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    init_pg("plait", rank, n, store_dir, timeout=30)
    _assert_native(dist.group.WORLD)
    if rank == 0:
        # As PyTorch's own test_send_recv_any_source: recv with no src returns the sender, and
        # irecv's Work reports it (sourceRank); each sender's two messages arrive once each.
        got = []
        for _ in range(n - 1):
            t = torch.zeros(3, dtype=torch.int64)
            got.append((dist.recv(t), t.tolist()))
            w = dist.irecv(t)
            w.wait()
            got.append((w._source_rank(), t.tolist()))
        dist.barrier()
        return got
    dist.send(torch.full((3,), 10 * rank, dtype=torch.int64), 0)
    dist.send(torch.full((3,), 10 * rank + 1, dtype=torch.int64), 0)
    dist.barrier()
    return None


@pytest.mark.parametrize(
    "hosts", [["a", "b"], ["a", "a", "b", "b"], ["a", "b", "b", "c"]], ids=["2x1", "2x2", "3-hosts"]
)
def test_recv_from_any_source_across_hosts(tmp_path, hosts):
    n = len(hosts)
    got = run_torch(_any_source, n, tmp_path, timeout=90, args=(hosts,))[0]
    assert all(src == t[0] // 10 and len(set(t)) == 1 for src, t in got), got  # the sender's data
    assert sorted(t[0] for _, t in got) == sorted(10 * r + k for r in range(1, n) for k in (0, 1)), got
    per_sender = {}
    for src, t in got:
        per_sender.setdefault(src, []).append(t[0] % 10)
    assert all(v == [0, 1] for v in per_sender.values()), got  # in each sender's order
