"""The torch backend "plait" when its ranks span simulated hosts: gloo between them over torch's store."""

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import plait  # noqa: E402
from test_torch_backend import init_pg, run_torch  # noqa: E402


def _collectives(rank, n, store_dir, hosts):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    init_pg("plait", rank, n, store_dir, timeout=30)
    comm = dist.group.WORLD._comm
    assert isinstance(comm, plait.HierCommunicator) and comm.engine == "gloo", repr(comm)
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
