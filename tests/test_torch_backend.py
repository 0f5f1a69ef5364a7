"""torch.distributed backend "plait": process groups, works and futures, errors, DDP and FSDP.

The ranks are forked by conftest's run_ranks (a hard deadline, failing ranks named, no shared
memory left behind) and rendezvous through a torch FileStore in the test's tmp_path. Training
runs compare plait with gloo from the same seed in the parent.
"""

import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import plait  # noqa: E402
import plait.torch  # noqa: E402,F401  (registers the backend)
from conftest import run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def init_pg(backend, rank, n, store_dir, timeout=60, **kw):
    path = os.path.join(str(store_dir), "store-" + uuid.uuid5(uuid.NAMESPACE_URL, backend).hex[:8])
    dist.init_process_group(
        backend,
        init_method="file://" + path,
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=timeout),
        **kw,
    )


def _rank_main(rank, n, addr, fn, args):
    torch.set_num_threads(1)  # n ranks share 2 cores; keep torch's own pool out of the way
    try:
        return fn(rank, n, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_torch(fn, n, store_dir, timeout=60, args=()):
    """fn(rank, n, store_dir, *args) on n forked ranks; their return values."""
    store_dir = str(store_dir)
    os.makedirs(store_dir, exist_ok=True)
    return run_ranks(_rank_main, n, timeout=timeout, args=(fn, (store_dir,) + tuple(args)))


# ---------------------------------------------------------------- groups, works, futures


def _basics(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    assert dist.get_backend() == "plait"
    pg = dist.group.WORLD
    assert pg._get_backend(torch.device("cpu")).name() == "plait" and pg.group_name
    t = torch.full((3,), float(rank))
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    deadline = time.monotonic() + 20
    while not fut.done():  # completes without anyone calling wait()
        assert time.monotonic() < deadline, "the future never completed without wait()"
        time.sleep(0.001)
    assert w.is_completed() and w.is_success()
    assert torch.equal(fut.value()[0], torch.full((3,), float(n * (n - 1) // 2)))
    chained = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert torch.equal(chained.wait(), torch.full((2,), 2.0 * n))
    # many async calls in flight, waited in reverse order
    ts = [torch.full((1000,), float(rank + k)) for k in range(20)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    for w in reversed(works):
        w.wait()
    for k, x in enumerate(ts):
        assert torch.equal(x, torch.full((1000,), float(n * (n - 1) // 2 + n * k)))
    # functional collectives (C++ callers that go through the group by name)
    import torch.distributed._functional_collectives as funcol

    y = funcol.all_reduce(torch.full((4,), float(rank + 1)), "sum", pg)
    assert torch.equal(y, torch.full((4,), float(n * (n + 1) // 2)))
    g = funcol.all_gather_tensor(torch.full((2,), float(rank)), 0, pg)
    assert torch.equal(g, torch.arange(n, dtype=torch.float32).repeat_interleave(2))
    rs = funcol.reduce_scatter_tensor(torch.ones(2 * n), "sum", 0, pg)
    assert torch.equal(rs, torch.full((2,), float(n)))
    # DeviceMesh over the plait world
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (n,))
    assert dist.get_backend(mesh.get_group()) == "plait"
    # coalescing manager with a device (start/end coalescing)
    from torch.distributed.distributed_c10d import _coalescing_manager

    a, b = torch.ones(3), torch.full((2,), 2.0)
    with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    assert torch.equal(a, torch.full((3,), float(n))) and torch.equal(b, torch.full((2,), 2.0 * n))
    # the group's own overloads: a bare tensor, a bare ReduceOp
    v = torch.full((2,), float(rank))
    pg.allreduce(v).wait()
    pg.allreduce([v], dist.ReduceOp.MAX).wait()
    assert torch.equal(v, torch.full((2,), float(n * (n - 1) // 2)))
    # any-source receive: the sender is what dist.recv returns
    if rank == 1:
        dist.send(torch.full((2,), 5.0), 0)
    elif rank == 0:
        got = torch.empty(2)
        assert dist.recv(got) == 1 and torch.equal(got, torch.full((2,), 5.0))
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("n", [2, 3])
def test_works_futures_and_callers(n, tmp_path):
    run_torch(_basics, n, tmp_path)


def _subgroups(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    evens = dist.new_group([r for r in range(n) if r % 2 == 0])
    odds = dist.new_group([r for r in range(n) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    other = odds if rank % 2 == 0 else evens
    assert other == dist.GroupMember.NON_GROUP_MEMBER
    members = [r for r in range(n) if r % 2 == rank % 2]
    t = torch.full((5,), float(rank))
    dist.all_reduce(t, group=mine)
    assert torch.equal(t, torch.full((5,), float(sum(members))))
    outs = [torch.empty(1) for _ in members]
    dist.all_gather(outs, torch.tensor([float(rank)]), group=mine)
    assert [int(o) for o in outs] == members
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=members[-1], group=mine)  # src is a global rank
    assert int(b) == members[-1]
    # new_subgroups, and interleaving world and subgroup calls
    sub, _ = dist.new_subgroups(group_size=1)
    w = dist.all_reduce(torch.ones(1), async_op=True)
    x = torch.tensor([3.0])
    dist.all_reduce(x, group=sub)
    assert float(x) == 3.0
    w.wait()
    # destroying a subgroup leaves the world working; new_group after that still works
    dist.destroy_process_group(mine)
    again = dist.new_group(list(range(n)))
    y = torch.ones(2)
    dist.all_reduce(y, group=again)
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((2,), float(n * n)))
    dist.destroy_process_group()
    import threading

    left = [t.name for t in threading.enumerate() if t.name.startswith("plait-torch")]
    assert not left, f"threads left after destroy_process_group: {left}"
    # a second world after destroying the first (fresh store file)
    init_pg("plait", rank, n, os.path.join(store_dir, "again"))
    z = torch.ones(1)
    dist.all_reduce(z)
    assert float(z) == n
    dist.destroy_process_group()
    return True


def test_subgroups_and_destroy(tmp_path):
    os.makedirs(tmp_path / "again")
    run_torch(_subgroups, 3, tmp_path)


def _tcp_init(rank, n, store_dir, port):
    dist.init_process_group("plait", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    got = float(t)
    t.untyped_storage().resize_(0)  # the backend must leave storages resizable (FSDP frees so)
    dist.destroy_process_group()
    assert got == n * (n + 1) / 2
    return got


def test_tcp_init_method(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_torch(_tcp_init, 2, tmp_path, args=(port,))


# ---------------------------------------------------------------- errors


def _errors(rank, n, store_dir):
    # a late rank: the other gets a timeout that is a DistBackendError and a TimeoutError
    init_pg("plait", rank, n, os.path.join(store_dir, "late"), timeout=2)
    if rank == 0:
        with pytest.raises(dist.DistBackendError) as e:
            dist.all_reduce(torch.ones(4))
        assert isinstance(e.value, plait.TimeoutError) and isinstance(e.value, TimeoutError), repr(e.value)
        assert "plait allreduce" in str(e.value)
    else:
        time.sleep(3)
    dist.destroy_process_group()
    # a rank that leaves: PeerLostError naming it
    init_pg("plait", rank, n, os.path.join(store_dir, "lost"), timeout=20)
    if rank == 0:
        w = dist.all_reduce(torch.ones(4), async_op=True)
        with pytest.raises(dist.DistBackendError, match="rank 1") as e:
            w.wait()
        assert isinstance(e.value, plait.PeerLostError), repr(e.value)
        # The Future fails from inside a then() callback (torch 2.13's DDP reducer segfaults on
        # a Python Future failed with set_exception), so torch wraps the error in RuntimeError.
        with pytest.raises(RuntimeError, match="PeerLostError.*rank 1"):
            w.get_future().wait()
    dist.destroy_process_group()
    # mismatched sizes: every rank raises a mismatch, which is a DistBackendError too
    init_pg("plait", rank, n, os.path.join(store_dir, "mismatch"), timeout=20)
    with pytest.raises(dist.DistBackendError) as e:
        dist.all_reduce(torch.ones(4 + rank), async_op=True).wait()
    assert isinstance(e.value, plait.PlaitError), type(e.value)
    with pytest.raises(dist.DistBackendError):  # the communicator is aborted now
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    # unsupported combinations fail on this rank only, and leave the group usable
    init_pg("plait", rank, n, os.path.join(store_dir, "unsupported"), timeout=20)
    with pytest.raises(ValueError):  # c10d's own check
        dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX)
    with pytest.raises(dist.DistBackendError, match="complex"):
        dist.group.WORLD.allreduce([torch.ones(2, dtype=torch.complex64)], _opts(dist.ReduceOp.MAX))
    t = torch.ones(1)
    dist.all_reduce(t)
    assert float(t) == n
    dist.destroy_process_group()
    return True


def _opts(op):
    o = dist.AllreduceOptions()
    o.reduceOp = op
    return o


def test_errors_are_dist_backend_errors(tmp_path):
    for d in ("late", "lost", "mismatch", "unsupported"):
        os.makedirs(tmp_path / d)
    run_torch(_errors, 2, tmp_path, timeout=90)


# ---------------------------------------------------------------- training: plait vs gloo


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )


def _plain(state):
    """Tensors as numpy copies: torch tensors sent through a pipe travel as shared memory that
    dies with the rank."""
    return {k: v.detach().clone().numpy() for k, v in state.items()}


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, torch.sin(x[:, :4]) + 0.1 * rank


def _ddp(rank, n, store_dir, backend, steps, hook=None):
    init_pg(backend, rank, n, store_dir)
    from torch.nn.parallel import DistributedDataParallel as DDP

    # several buckets; one for PowerSGD, whose callbacks issue collectives of their own: with
    # several buckets, those race the next bucket's on every backend (plait reports a mismatch)
    model = DDP(_mlp(0), bucket_cap_mb=0.004 if hook is None else 25)
    if hook == "powersgd":  # its future callbacks issue all-reduces and wait on them
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

        state = P.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3, min_compression_rate=0.5
        )
        model.register_comm_hook(state, P.powerSGD_hook)
    losses = _train(model, rank, steps, momentum=0.9)
    state = _plain(model.module.state_dict())
    dist.destroy_process_group()
    return state, losses


@pytest.mark.slow
@pytest.mark.parametrize("n,hook", [(2, None), (3, None), (2, "powersgd")])
def test_ddp_matches_gloo(n, hook, tmp_path):
    steps = 200 if hook is None else 40
    plait_runs = run_torch(_ddp, n, tmp_path / "plait", timeout=120, args=("plait", steps, hook))
    gloo_runs = run_torch(_ddp, n, tmp_path / "gloo", timeout=120, args=("gloo", steps, hook))
    for r in range(1, n):  # every rank ends with the same parameters
        for k, v in plait_runs[0][0].items():
            assert (v == plait_runs[r][0][k]).all(), f"plait rank {r} differs from rank 0 in {k}"
    for k, v in plait_runs[0][0].items():
        g = gloo_runs[0][0][k]
        if n == 2:  # a + b == b + a: sums of two are bitwise the same in any order
            assert (v == g).all(), f"{k}: max |plait - gloo| = {abs(v - g).max()}"
        else:  # three terms: summation order may differ from gloo's ring in the last bit
            assert abs(v - g).max() <= 1e-6, f"{k}: max |plait - gloo| = {abs(v - g).max()}"
    assert plait_runs[0][1][-1] < plait_runs[0][1][0]  # it trained


def _train(model, rank, steps, momentum=0.0):
    """SGD on the rank's batches; the loss of every step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _fsdp2(rank, n, store_dir, backend, steps):
    init_pg(backend, rank, n, store_dir)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (n,))
    model = _mlp(0)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if backend == "gloo":  # gloo has no AVG: SUM, then divide (what plait's AVG computes)
        model.set_force_sum_reduction_for_comms(True)
    losses = _train(model, rank, steps)
    full = _plain({k: v.full_tensor() for k, v in model.state_dict().items()})
    dist.destroy_process_group()
    return full, losses


def _fsdp1(rank, n, store_dir, backend, steps):
    init_pg(backend, rank, n, store_dir)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    model = FSDP(
        _mlp(0),
        device_id=torch.device("cpu"),
        use_orig_params=True,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
    )
    losses = _train(model, rank, steps)
    with FSDP.summon_full_params(model):
        full = _plain(model.state_dict())
    dist.destroy_process_group()
    return full, losses


@pytest.mark.slow
@pytest.mark.parametrize("which", ["fsdp2", "fsdp1"])
def test_fsdp_matches_gloo(which, tmp_path):
    fn = {"fsdp2": _fsdp2, "fsdp1": _fsdp1}[which]
    steps, n = 30, 2
    p = run_torch(fn, n, tmp_path / "plait", timeout=120, args=("plait", steps))
    g = run_torch(fn, n, tmp_path / "gloo", timeout=120, args=("gloo", steps))
    assert p[0][1] == g[0][1], "loss curves differ"
    for k, v in p[0][0].items():
        assert (v == g[0][0][k]).all(), f"{k}: max |plait - gloo| = {abs(v - g[0][0][k]).max()}"


# ---------------------------------------------------------------- the example, two launchers


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["plait-run", "torchrun"])
def test_example_ddp_train(launcher):
    env = dict(os.environ)  # the plait under test: installed, or on the caller's PYTHONPATH
    script = os.path.join(ROOT, "examples", "ddp_train.py")
    if launcher == "plait-run":
        cmd = [sys.executable, "-m", "plait.run", "-n", "2", script, "--epochs", "2"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            script,
            "--epochs",
            "2",
        ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "epoch 1" in p.stdout and "communication" in p.stdout, p.stdout


# ---------------------------------------------------------------- shared-memory tensors


def _shared_tensors(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    comm = plait.torch.communicator()
    before = comm.mapped_bytes
    count = 300_001  # above the single_copy thresholds and its 256 KiB chunk
    base = torch.arange(count, dtype=torch.int64) % 64  # sums stay exact in bfloat16
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        t = plait.torch.empty(count, dtype=dtype)
        assert t.shape == (count,) and t.dtype == dtype and t.is_contiguous()
        assert not t.any()  # zero-filled
        t.copy_((base * (rank + 1)).to(dtype))
        dist.all_reduce(t)
        want = (base * sum(range(1, n + 1))).to(dtype)
        assert torch.equal(t, want), (rank, dtype)
        g = plait.torch.empty((n, count), dtype=dtype)
        dist.all_gather_into_tensor(g, t)
        assert all(torch.equal(g[r], want) for r in range(n)), (rank, dtype)
    two = plait.torch.zeros(2, 3)
    assert two.shape == (2, 3) and two.dtype == torch.get_default_dtype()
    # the fast path was taken: this rank reduced from and wrote into its peers' mapped tensors
    return comm.mapped_bytes - before, comm.single_copy


def test_shared_memory_tensors_through_the_backend(tmp_path):
    for moved, single_copy in run_torch(_shared_tensors, 2, tmp_path, timeout=90):
        assert moved > 0 or not single_copy, moved
