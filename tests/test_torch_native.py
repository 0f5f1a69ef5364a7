"""The native (C++) torch backend: what only it does, and its build (one error when it cannot).

The collectives themselves are in test_torch_backend.py, test_torch_collectives.py and
test_torch_faults.py; these tests are about what is particular to the C++ backend and its build.
"""

import io
import subprocess
import sys
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import plait  # noqa: E402 - after the importorskip
import plait.torch  # noqa: E402 - after the importorskip
import torch.distributed as dist  # noqa: E402 - after the importorskip
from test_run import _ENV  # noqa: E402 - after the importorskip
from test_torch_backend import init_pg, run_torch  # noqa: E402 - after the importorskip

# import plait.torch above fails when the backend cannot be built: no skip hides that.


def _identity(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    assert type(backend) is torch._C._distributed_c10d.Backend  # a C++ Backend, not a Python group
    assert backend.name() == "plait" and dist.get_backend(pg) == "plait"
    assert set(pg._device_types) == {torch.device("cpu"), torch.device("cuda")}
    comm = plait.torch.communicator()
    assert comm.size == n and comm.rank == rank
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), float(n * (n + 1) // 2)))
    return True


def test_groups_are_cpp_backends(tmp_path):
    run_torch(_identity, 2, tmp_path)


def _timeout_text(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir, timeout=2)
    if rank == 0:
        with pytest.raises(dist.DistBackendError) as e:
            dist.all_reduce(torch.ones(4))
        assert isinstance(e.value, plait.TimeoutError), repr(e.value)
        text = str(e.value)
        # torch's convention, as gloo's errors have it, and plait's own account of the call
        assert " Timed out " in text and "timeout" in text and "plait allreduce" in text, text
        assert "rank 0" in text, text
    else:
        time.sleep(3)
    return True


def test_timeout_text_follows_torch(tmp_path):
    run_torch(_timeout_text, 2, tmp_path, timeout=60)


def _callback_issues(rank, n, store_dir):
    """A Future callback that issues a collective and waits on it (PowerSGD does) completes."""
    init_pg("plait", rank, n, store_dir)

    def again(fut):
        t = fut.value()[0] * 2
        dist.all_reduce(t, async_op=True).wait()
        return t

    chained = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(again)
    assert torch.equal(chained.wait(), torch.full((3,), 2.0 * n * n))
    # many in flight, some waited, the last through its future only
    ts = [torch.full((7,), float(k + rank)) for k in range(50)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    works[10].wait()
    works[-1].get_future().wait()
    for k, t in enumerate(ts):
        assert torch.equal(t, torch.full((7,), float(n * k + n * (n - 1) // 2))), k
    return True


def test_future_callbacks_may_issue_and_wait(tmp_path):
    run_torch(_callback_issues, 2, tmp_path)


def _probe(env):
    code = "import plait.torch as t; print('native' if t.native() else 'python')"
    e = dict(_ENV, **env)  # the plait under test, installed or on PYTHONPATH
    return subprocess.run(
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=600, check=False
    )


def _build_error(p):
    assert p.returncode != 0, p.stdout + p.stderr
    lines = [line for line in p.stderr.splitlines() if "NativeBuildError: " in line]
    assert len(lines) == 1 and "plait.torch: cannot compile the native torch backend" in lines[0], p.stderr
    return lines[0]


def test_unwritable_cache_fails_import_with_one_message(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    line = _build_error(_probe({"PLAIT_CACHE_DIR": str(blocker / "cache")}))
    assert "writable cache directory" in line and "PLAIT_CACHE_DIR" in line, line
    assert "compiler" not in line and "ninja" not in line, line  # only what is missing


def test_missing_compiler_and_ninja_are_named(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {"PATH": str(empty), "PLAIT_CACHE_DIR": str(tmp_path / "cache")}
    line = _build_error(_probe(dict(env, CXX="")))
    assert "C++17 compiler" in line and "apt-get install g++" in line, line
    assert "ninja (not on PATH): pip install ninja" in line, line
    assert "cache directory" not in line and "headers" not in line, line
    line = _build_error(_probe(dict(env, CXX="no-such-c++")))
    assert "'no-such-c++' is not on PATH" in line, line


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_compile_progress_is_one_line():
    from plait.torch import _native

    s = _Stream(tty=False)
    _native._Progress("plait.torch: compiling", s, interval=0.01).end(True)
    assert s.getvalue() == "plait.torch: compiling\n"
    s = _Stream(tty=True)
    p = _native._Progress("plait.torch: compiling", s, interval=0.01)
    time.sleep(0.2)
    p.end(True)
    text = s.getvalue()
    assert text.count("\n") == 1 and text.endswith(" s)\n"), repr(text)
    head, tail = text.split(" done (")
    assert head.startswith("plait.torch: compiling.") and set(head[len("plait.torch: compiling") :]) == {"."}


def _coalesced(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    from torch.distributed.distributed_c10d import _coalescing_manager

    c = torch.arange(5, dtype=torch.float32) * 10
    if rank == 0:
        # two coalesced allreduces are one plait call: it matches rank 1's single 5-element one
        a, b = torch.arange(3, dtype=torch.float32), torch.arange(3, 5, dtype=torch.float32)
        with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
            dist.all_reduce(a, async_op=True)
            dist.all_reduce(b)
        cm.wait()
        assert torch.equal(torch.cat([a, b]), torch.arange(5, dtype=torch.float32) + c), (a, b)
    else:
        dist.all_reduce(c)
    # C++ callers between start and end coalescing (not torch's Python capture): allreduces of
    # one dtype and op fuse; another dtype, op or collective issues what came before, in order
    pg = dist.group.WORLD
    x = torch.full((4,), rank + 1, dtype=torch.int64)
    y = torch.full((3,), float(rank + 1))
    z = torch.full((2,), float(rank + 1))
    g = torch.full((2,), float(rank))
    bo = dist.BroadcastOptions()
    bo.rootRank = 1
    pg._start_coalescing(torch.device("cpu"))
    works = [
        pg.allreduce([x]),
        pg.allreduce([y], dist.ReduceOp.MAX),
        pg.broadcast([g], bo),
        pg.allreduce([z]),
        pg.allreduce([z.clone()]),
    ]
    pg._end_coalescing(torch.device("cpu")).wait()
    assert all(w.is_completed() for w in works)
    s = n * (n + 1) // 2
    assert torch.equal(x, torch.full((4,), s, dtype=torch.int64)) and torch.equal(
        y, torch.full((3,), float(n))
    )
    assert torch.equal(z, torch.full((2,), float(s))) and torch.equal(g, torch.full((2,), 1.0))
    return True


def test_coalesced_allreduces_are_one_call(tmp_path):
    run_torch(_coalesced, 2, tmp_path)


def _split(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    sub = dist.group.WORLD.split_group([0, 2], group_name="plait-sub02")
    if rank == 1:
        assert sub is None
    else:
        assert sub.size() == 2 and sub.rank() == rank // 2
        assert sub._get_backend(torch.device("cpu")).name() == "plait"
        t = torch.full((3,), float(rank + 1))
        sub.allreduce([t]).wait()
        assert torch.equal(t, torch.full((3,), 4.0))  # ranks 0 and 2: 1 + 3
    t = torch.ones(2)
    dist.all_reduce(t)  # the parent goes on
    assert torch.equal(t, torch.full((2,), float(n)))
    return True


def test_split_group(tmp_path):
    run_torch(_split, 3, tmp_path)


def _mixed(rank, n, store_dir, backend):
    init_pg(backend, rank, n, store_dir)
    pg = dist.group.WORLD
    assert pg._get_backend(torch.device("cpu")).name() == "plait"
    other = dict(kv.split(":") for kv in backend.split(",")).get("cuda")
    if other in ("gloo", "nccl"):  # plait for CPU tensors beside another backend for CUDA ones
        assert pg._get_backend(torch.device("cuda")).name() == other
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(n * (n + 1) // 2)))
    return True


_NCCL = pytest.mark.skipif(
    not (dist.is_nccl_available() and torch.cuda.is_available()),
    reason="needs a CUDA build of torch and a GPU",
)


@pytest.mark.parametrize(
    "backend",
    [
        "cpu:plait",
        "cpu:plait,cuda:plait",
        "cpu:plait,cuda:gloo",
        pytest.param("cpu:plait,cuda:nccl", marks=_NCCL),
    ],
)
def test_device_backend_strings(backend, tmp_path):
    run_torch(_mixed, 2, tmp_path, args=(backend,))


def _tags(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    if rank == 0:
        for tag in (7, 9):
            dist.isend(torch.full((3,), float(tag)), 1, tag=tag).wait()
    else:
        nine, seven = torch.empty(3), torch.empty(3)
        works = [dist.irecv(nine, 0, tag=9), dist.irecv(seven, 0, tag=7)]  # 9 posted before 7
        for w in works:
            w.wait()
        assert torch.equal(nine, torch.full((3,), 9.0)) and torch.equal(seven, torch.full((3,), 7.0))
    dist.barrier()
    return True


def test_recv_matches_by_tag_as_gloo(tmp_path):
    run_torch(_tags, 2, tmp_path)


def _sparse(rank, n, store_dir, backend, steps):
    init_pg(backend, rank, n, store_dir)
    # a sparse all_reduce: duplicate indices across ranks sum, as gloo's do
    i = torch.tensor([[rank, 3]])
    t = torch.sparse_coo_tensor(i, torch.tensor([1.0 + rank, 10.0]), (5,))
    dist.all_reduce(t)
    dense = t.to_dense()
    want = torch.zeros(5)
    for r in range(n):
        want[r] += 1.0 + r
    want[3] += 10.0 * n
    assert torch.equal(dense, want), dense
    # DDP over a sparse embedding
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 4, sparse=True)
    model = DDP(emb)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        ids = torch.tensor([(7 * step + 3 * rank + k) % 50 for k in range(6)])
        loss = (model(ids) * float(rank + 1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return emb.weight.detach().tolist()  # plain data: tensors would cross as shared memory


def test_sparse_allreduce_and_ddp_over_sparse_embedding(tmp_path):
    p = run_torch(_sparse, 2, tmp_path / "plait", args=("plait", 5))
    g = run_torch(_sparse, 2, tmp_path / "gloo", args=("gloo", 5))
    assert p[0] == p[1] and p[0] == g[0]


def _fsdp2_alloc(rank, n, store_dir, backend, steps):
    init_pg(backend, rank, n, store_dir)
    from test_torch_backend import _train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (n,))
    model = _wide_mlp(0)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)  # gloo has no AVG; the same op on both
    shared = mapped = None
    if backend == "plait":
        plait.torch.use_shared_buffers(model)  # allocate_tensor for every FSDP module's buffers
        t = dist.group.WORLD._get_backend(torch.device("cpu")).allocate_tensor(
            1000, dtype=torch.float32, device=torch.device("cpu")
        )
        shared = plait.torch.is_shared(t)
        del t
        mapped = plait.torch.communicator().mapped_bytes
    else:
        model.set_allocate_memory_from_process_group_for_comm(True)  # gloo: torch.empty
    _train(model, rank, steps)
    if backend == "plait":
        mapped = plait.torch.communicator().mapped_bytes - mapped
    full = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    return full, shared, mapped


def test_fsdp2_buffers_from_allocate_tensor_match_gloo(tmp_path):
    p = run_torch(_fsdp2_alloc, 2, tmp_path / "plait", timeout=120, args=("plait", 10))
    g = run_torch(_fsdp2_alloc, 2, tmp_path / "gloo", timeout=120, args=("gloo", 10))
    assert p[0][1] is True  # the backend's tensors live in plait shared memory
    assert p[0][2] > 0 and p[1][2] > 0  # and peers reached FSDP2's buffers through mappings
    assert p[0][0] == g[0][0] and p[1][0] == g[1][0]


def _wide_mlp(seed, width=128):
    torch.manual_seed(seed)  # layers of 64 KiB: big enough for plait's single-copy path
    return torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 4),
    )


def _ddp_shared(rank, n, store_dir, backend, steps, shared, as_view):
    init_pg(backend, rank, n, store_dir)
    from test_torch_backend import _train
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_wide_mlp(0), bucket_cap_mb=0.05, gradient_as_bucket_view=as_view)
    if shared:
        assert plait.torch.use_shared_buffers(model) is model
    mapped = plait.torch.communicator().mapped_bytes if backend == "plait" else 0
    losses = _train(model, rank, steps)
    grads = [plait.torch.is_shared(p.grad) for p in model.parameters()]
    if backend == "plait":
        mapped = plait.torch.communicator().mapped_bytes - mapped
    return [p.detach().tolist() for p in model.parameters()], losses, mapped, grads


@pytest.mark.parametrize("as_view", [pytest.param(False, marks=pytest.mark.slow), True])
def test_ddp_buckets_in_shared_memory_match_gloo(as_view, tmp_path):
    g = run_torch(_ddp_shared, 2, tmp_path / "gloo", timeout=120, args=("gloo", 6, False, as_view))
    p = run_torch(_ddp_shared, 2, tmp_path / "plait", timeout=120, args=("plait", 6, True, as_view))
    q = run_torch(_ddp_shared, 2, tmp_path / "private", timeout=120, args=("plait", 6, False, as_view))
    for r in range(2):
        assert p[r][0] == g[r][0] and p[r][1] == g[r][1]  # bitwise: parameters and every loss
        assert q[r][0] == g[r][0]
        assert p[r][2] > 0 and q[r][2] == 0  # peers reached the buckets through mappings
        # Gradients that are views of the buckets moved with them; copies stayed private.
        assert p[r][3] == [as_view] * 6 and q[r][3] == [False] * 6


def _share_storage(rank, n, store_dir):
    import numpy as np

    init_pg("plait", rank, n, store_dir)
    from plait.torch import _native

    t = torch.arange(1000, dtype=torch.float32)
    view = t[10:20]
    assert _native.share_storage(t) and plait.torch.is_shared(t) and plait.torch.is_shared(view)
    assert torch.equal(view, torch.arange(10, 20, dtype=torch.float32))  # contents moved along
    assert _native.share_storage(view)  # already plait's: nothing moves
    a = np.zeros(8, np.float32)
    assert not _native.share_storage(torch.from_numpy(a))  # numpy's memory stays numpy's
    assert not _native.share_storage(torch.empty(0))
    dist.all_reduce(view)
    assert torch.equal(t[10:20], torch.arange(10, 20, dtype=torch.float32) * n)
    # Freed regions go back to a pool: a new tensor of the same size is the same memory, which
    # peers have mapped already (FSDP2 allocates its buffers anew every step, in the same sizes).
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    a = backend.allocate_tensor(3000, dtype=torch.float32, device=torch.device("cpu"))
    where = a.data_ptr()
    assert plait.torch.is_shared(a)
    del a
    b = backend.allocate_tensor(3000, dtype=torch.float32, device=torch.device("cpu"))
    c = backend.allocate_tensor(3000, dtype=torch.float32, device=torch.device("cpu"))
    assert b.data_ptr() == where and c.data_ptr() != where and plait.torch.is_shared(c)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        plait.torch.use_shared_buffers(torch.nn.Linear(2, 2))
    return True


def test_share_storage_moves_torch_allocations_only(tmp_path):
    assert run_torch(_share_storage, 2, tmp_path) == [True, True]


def _custom_ops(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    name = dist.group.WORLD.group_name
    t = torch.full((2, 3), float(rank + 1))
    torch.ops.plait.all_reduce_(t, "sum", name)
    assert torch.equal(t, torch.full((2, 3), float(n * (n + 1) // 2)))
    g = torch.ops.plait.all_gather(torch.full((1, 2), float(rank)), name)
    assert torch.equal(g, torch.arange(n, dtype=torch.float32).repeat_interleave(2).view(n, 2))

    def layer(x, w):  # a tensor-parallel step: local matmul, then the sum over ranks
        y = x @ w
        torch.ops.plait.all_reduce_(y, "sum", name)
        return torch.ops.plait.all_gather(y.relu(), name)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x, w = torch.ones(2, 4), torch.full((4, 3), float(rank + 1))
    want = layer(x.clone(), w)
    got = compiled(x.clone(), w)
    assert torch.equal(got, want) and got.shape == (2 * n, 3), got
    return True


def test_custom_ops_eager_and_compiled(tmp_path):
    run_torch(_custom_ops, 2, tmp_path, timeout=300)


def _bf16_hooks(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
        bf16_compress_hook,
    )
    from torch.nn.parallel import DistributedDataParallel as DDP

    def bf16_hook(group, bucket):  # the hand-written form docs/torch.md shows
        buf = bucket.buffer()
        low = buf.to(torch.bfloat16).div_(dist.get_world_size(group))
        fut = dist.all_reduce(low, group=group, async_op=True).get_future()
        return fut.then(lambda f: buf.copy_(f.value()[0]))

    out = []
    torch.manual_seed(0)
    hooks = [bf16_hook, bf16_hook]
    try:  # torch 2.13 keeps its own bf16 hook to NCCL/XCCL; later releases let any backend have it
        DDP(torch.nn.Linear(8, 4)).register_comm_hook(dist.group.WORLD, bf16_compress_hook)
        hooks.append(bf16_compress_hook)
    except TypeError as e:
        assert "NCCL" in str(e), e
    for hook in hooks:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 4))
        model.register_comm_hook(dist.group.WORLD, hook)
        x = torch.full((2, 8), float(rank + 1))
        model(x).sum().backward()
        # grads are small integers times 1/n: exact in bfloat16
        out.append([p.grad.tolist() for p in model.parameters()])
    try:  # torch 2.13 keeps dist.monitored_barrier to gloo; later releases reach the backend
        dist.monitored_barrier(timeout=timedelta(seconds=60))
    except ValueError as e:
        assert "GLOO" in str(e), e
    return out


def test_bf16_hooks_and_monitored_barrier(tmp_path):
    a, b = run_torch(_bf16_hooks, 2, tmp_path)
    assert a == b and all(x == a[0] for x in a), (a, b)  # torch's own hook too, where it is allowed
    # the mean of ranks 1 and 2: the weight's gradient is 1.5 * 2 rows for every entry
    assert a[0][0] == [[3.0] * 8] * 4 and a[0][1] == [2.0] * 4, a[0]


def _monitored(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    pg = dist.group.WORLD  # the backend's own monitored barrier, under any torch release
    pg.monitored_barrier(timedelta(seconds=60), wait_all_ranks=True)
    if rank == 2:
        time.sleep(3.0)
    try:
        pg.monitored_barrier(timedelta(seconds=1), wait_all_ranks=True)
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        return type(e).__name__, str(e)
    return None, "passed"


def test_monitored_barrier_names_the_late_rank_on_every_rank(tmp_path):
    got = run_torch(_monitored, 3, tmp_path, timeout=90)
    for r in (0, 1):
        kind, msg = got[r]
        assert kind is not None and "ranks that have not arrived: 2" in msg, (r, got[r])
    assert got[2][0] is not None, got[2]  # it arrived after the others had failed


def test_a_killed_build_s_leftover_lock_does_not_hang_import(tmp_path):
    """torch's build baton (a `lock` file) outlives a build killed midway, and torch then waits
    for it forever; plait builds under its own file lock, so it clears that leftover first."""
    import os
    import shutil

    from plait.torch import _native

    built = os.path.dirname(_native._module.__file__)
    cache = tmp_path / "cache"
    shutil.copytree(built, cache / os.path.basename(built))  # keeps mtimes: nothing to recompile
    (cache / os.path.basename(built) / "lock").write_text("")  # as a killed build leaves it
    env = dict(os.environ, PLAIT_CACHE_DIR=str(cache))
    out = subprocess.run(
        [sys.executable, "-c", "import plait.torch; print('imported')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr
