"""plait.horovod.torch training pieces: DistributedOptimizer (and its options) against one process
training on the whole batch, broadcast_parameters / optimizer state / objects, allgather_object,
Compression and SyncBatchNorm."""

import pytest

torch = pytest.importorskip("torch")

STEPS = 3


def _np(x):
    """Results go back to the test as numpy arrays: torch's pickling of tensors would share
    memory with a rank that has exited by the time the parent reads them."""
    if isinstance(x, torch.Tensor):
        return x.detach().numpy().copy()
    if isinstance(x, (list, tuple)):
        return type(x)(_np(v) for v in x)
    if isinstance(x, dict):
        return {k: _np(v) for k, v in x.items()}
    return x


def _t(x):
    import numpy as np

    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_t(v) for v in x)
    if isinstance(x, dict):
        return {k: _t(v) for k, v in x.items()}
    return x


def _hvd():
    import plait.horovod.torch as hvd

    hvd.init()
    return hvd


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()


def _batch(step, rank, rows=2):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 4, generator=g, dtype=torch.float64), torch.randn(
        rows, 1, generator=g, dtype=torch.float64
    )


def _reference(n, passes=1, op_sum=False):
    """One process: the gradient of the mean over ranks of each rank's loss (Sum: their sum)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(n):
            for p in range(passes):
                x, y = _batch(step * passes + p, r)
                loss = torch.nn.functional.mse_loss(model(x), y)
                (loss if op_sum else loss / n).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _reference_rank(_rank, _n, _addr, n, passes=1, op_sum=False):
    # The reference trains in a forked child, never in pytest's own process: autograd run here
    # leaves thread-local state that later forked torch ranks inherit, and their gloo groups then
    # deadlock on the GIL when destroyed (seen: DDP tests hanging after these ran).
    return _np(_reference(n, passes, op_sum))


def _train(rank, n, _addr, kind):
    hvd = _hvd()
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kw = {"named_parameters": model.named_parameters()}
    passes = 1
    if kind == "passes":
        passes = kw["backward_passes_per_step"] = 2
    elif kind == "groups":
        kw["groups"] = 2
    elif kind == "group_lists":
        ps = list(model.parameters())
        kw["groups"] = [ps[:2], ps[2:]]
    elif kind == "predivide":
        kw["gradient_predivide_factor"] = 2.0
    elif kind == "sum":
        kw["op"] = hvd.Sum
    elif kind == "fp16":
        kw["compression"] = hvd.Compression.fp16
    elif kind == "unnamed":
        del kw["named_parameters"]
    opt = hvd.DistributedOptimizer(base, **kw)
    assert isinstance(opt, torch.optim.SGD)
    for step in range(STEPS):
        opt.zero_grad()
        for p in range(passes):
            x, y = _batch(step * passes + p, rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
        if kind == "skip" and step == 0:
            opt.synchronize()  # e.g. to clip gradients before the step
            with opt.skip_synchronize():
                opt.step()
            continue
        opt.step()
    if kind == "zero_grad":
        torch.nn.functional.mse_loss(model(_batch(9, rank)[0]), _batch(9, rank)[1]).backward()
        with pytest.raises(AssertionError, match="zero_grad"):
            opt.zero_grad()
        opt.synchronize()
    hvd.shutdown()
    return _np([p.detach().clone() for p in model.parameters()])


@pytest.mark.parametrize(
    "kind",
    ["plain", "passes", "groups", "group_lists", "predivide", "sum", "fp16", "unnamed", "skip", "zero_grad"],
)
def test_distributed_optimizer(ranks, kind):
    n = 2
    got = _t(ranks(_train, n, args=(kind,), timeout=120))
    want = _t(ranks(_reference_rank, 1, args=(n, 2 if kind == "passes" else 1, kind == "sum")))[0]
    tol = 2e-3 if kind == "fp16" else 1e-12
    for g, w in zip(got[0], want):
        assert torch.allclose(g, w, atol=tol, rtol=0), (kind, g, w)
    for g, h in zip(got[0], got[1]):
        assert torch.equal(g, h)  # every rank holds the same parameters


def _train3(rank, n, _addr):
    return _train(rank, n, _addr, "plain")


def test_distributed_optimizer_three_ranks(ranks):
    got = _t(ranks(_train3, 3, timeout=120))
    for g, w in zip(got[2], _t(ranks(_reference_rank, 1, args=(3,)))[0]):
        assert torch.allclose(g, w, atol=1e-12, rtol=0)


def _sparse(rank, n, _addr, as_dense):
    hvd = _hvd()
    emb = torch.nn.Embedding(6, 2, sparse=True).double()
    torch.nn.init.constant_(emb.weight, 1.0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=1.0),
        named_parameters=emb.named_parameters(),
        sparse_as_dense=as_dense,
    )
    opt.zero_grad()
    emb(torch.tensor([rank, 5])).sum().backward()
    opt.step()
    hvd.shutdown()
    return _np(emb.weight.detach().clone())


@pytest.mark.parametrize("as_dense", [False, True])
def test_sparse_gradients(ranks, as_dense):
    n = 2
    got = _t(ranks(_sparse, n, args=(as_dense,), timeout=90))
    want = torch.ones(6, 2, dtype=torch.float64)
    for r in range(n):
        want[r] -= 1.0 / n  # each row r is used by rank r only: averaged gradient 1/n
    want[5] -= 1.0  # every rank uses row 5
    assert torch.allclose(got[0], want) and torch.allclose(got[1], want)


def _broadcasts(rank, n, _addr):
    hvd = _hvd()
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == 0:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    st = opt.state_dict()
    exp_avg = [st["state"][i]["exp_avg"].clone() for i in sorted(st["state"])]
    obj = hvd.broadcast_object({"epoch": 7, "who": rank} if rank == 1 else None, root_rank=1)
    objs = hvd.allgather_object(("rank", rank, [rank] * rank))
    # parameters given as named_parameters() and as a plain list work too
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    hvd.shutdown()
    return _np((state, exp_avg, st["param_groups"][0]["lr"], obj, objs))


def test_broadcast_parameters_state_objects(ranks):
    n = 3
    got = _t(ranks(_broadcasts, n, timeout=120))
    for r in range(1, n):
        for k in got[0][0]:
            assert torch.equal(got[r][0][k], got[0][0][k])
        for a, b in zip(got[r][1], got[0][1]):
            assert torch.equal(a, b) and a.abs().sum() > 0
        assert got[r][2] == 0.01
    for r in range(n):
        assert got[r][3] == {"epoch": 7, "who": 1}
        assert got[r][4] == [("rank", q, [q] * q) for q in range(n)]


def _sync_bn(rank, n, _addr):
    hvd = _hvd()
    torch.manual_seed(0)
    full = torch.randn(4 * n, 3, 5, dtype=torch.float64)
    w = torch.randn(4 * n, 3, 5, dtype=torch.float64)
    x = full[4 * rank : 4 * (rank + 1)].clone().requires_grad_(True)
    bn = hvd.SyncBatchNorm(3).double()
    out = bn(x)
    (out * w[4 * rank : 4 * (rank + 1)]).sum().backward()
    gw = hvd.allreduce(bn.weight.grad, op=hvd.Sum)
    hvd.shutdown()
    return _np((out.detach(), x.grad, bn.running_mean.clone(), bn.running_var.clone(), gw, full, w))


def _bn_reference(_rank, _n, _addr, full, w):
    # In a forked child, as _reference_rank says why.
    full, w = torch.from_numpy(full), torch.from_numpy(w)
    ref = torch.nn.BatchNorm1d(3).double()
    x = full.clone().requires_grad_(True)
    out = ref(x)
    (out * w).sum().backward()
    return _np((out.detach(), x.grad, ref.running_mean, ref.running_var, ref.weight.grad))


def test_sync_batch_norm(ranks):
    n = 2
    got = _t(ranks(_sync_bn, n, timeout=90))
    full, w = got[0][5], got[0][6]
    out, xgrad, mean, var, wgrad = _t(ranks(_bn_reference, 1, args=_np((full, w))))[0]
    for r in range(n):
        o, g, rm, rv, gw = got[r][:5]
        assert torch.allclose(o, out[4 * r : 4 * (r + 1)], atol=1e-10)
        assert torch.allclose(g, xgrad[4 * r : 4 * (r + 1)], atol=1e-10)
        assert torch.allclose(rm, mean, atol=1e-12) and torch.allclose(rv, var, atol=1e-12)
        assert torch.allclose(gw, wgrad, atol=1e-10)


def _compression(rank, n, _addr):
    hvd = _hvd()
    x = torch.tensor([1.5, -2.25, 1024.0], dtype=torch.float32) * (rank + 1)
    out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    ints = hvd.allreduce(torch.tensor([3]), op=hvd.Sum, compression=hvd.Compression.fp16)
    hvd.shutdown()
    return _np((out, ints))


def test_compression(ranks):
    out, ints = _t(ranks(_compression, 2, timeout=60)[0])
    assert out.dtype == torch.float32 and out.tolist() == [4.5, -6.75, 3072.0]
    assert ints.tolist() == [6]
