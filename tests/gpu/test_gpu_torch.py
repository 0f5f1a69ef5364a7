"""The torch backend with CUDA tensors (one rank on one GPU): all_reduce, reduce_scatter_tensor and
all_gather_into_tensor on torch's current stream, synchronous and async, exact values."""
import pytest

from conftest import run_ranks
from gpu_util import skip_reason

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))]


def _torch_cuda(rank, n, store):
    import torch
    import torch.distributed as dist

    import plait.torch  # noqa: F401
    torch.cuda.set_device(rank)
    dist.init_process_group("plait", store=dist.HashStore(), rank=rank, world_size=n)
    try:
        x = torch.arange(1000, dtype=torch.float32, device="cuda")
        dist.all_reduce(x)
        ok = [torch.equal(x.cpu(), torch.arange(1000, dtype=torch.float32) * n)]
        y = torch.arange(1000, dtype=torch.bfloat16, device="cuda")
        work = dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True)
        work.wait()
        ok.append(torch.equal(y.cpu(), torch.arange(1000, dtype=torch.bfloat16)))
        out = torch.empty(1000 * n, dtype=torch.int64, device="cuda")
        dist.all_gather_into_tensor(out, torch.full((1000,), 7, dtype=torch.int64, device="cuda"))
        ok.append(bool((out.cpu() == 7).all()))
        rs = torch.empty(500, dtype=torch.float16, device="cuda")
        dist.reduce_scatter_tensor(rs, torch.ones(500 * n, dtype=torch.float16, device="cuda"))
        ok.append(bool((rs.cpu() == n).all()))
        return ok
    finally:
        dist.destroy_process_group()


def test_torch_cuda_tensors_world_of_one():
    assert run_ranks(_torch_cuda, 1, 300, start_method="spawn") == [[True, True, True, True]]
