"""plait.horovod with real CUDA tensors: a world of one on one GPU (every op, exact values, on a
side stream the user's work is ordered with) and two ranks sharing the GPU (allreduce and
allgather over the CUDA IPC transport). tests/test_horovod_gpu.py checks the same logic on CPU."""

import pytest

from conftest import run_ranks
from gpu_util import RUN_TIMEOUT, skip_reason

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))]


def _horovod_cuda(rank, n, store):
    import torch

    import plait.horovod.torch as hvd

    torch.cuda.set_device(0)
    hvd.init()
    try:
        ok = []
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # produced on a stream of the user's: the op must wait for it
            x = torch.arange(1 << 20, dtype=torch.float32, device="cuda") + rank
        with torch.cuda.stream(side):
            hvd.allreduce_(x, op=hvd.Sum, name="x")
        tri = n * (n - 1) // 2
        ok.append(torch.equal(x.cpu(), torch.arange(1 << 20, dtype=torch.float32) * n + tri))
        g = [torch.full((k + 1,), float(rank + k), device="cuda") for k in range(50)]
        hvd.grouped_allreduce_(g, op=hvd.Sum, name="g")
        ok.append(
            all(torch.equal(t.cpu(), torch.full((k + 1,), float(n * k + tri))) for k, t in enumerate(g))
        )
        a = hvd.allgather(torch.full((rank + 1, 3), rank, dtype=torch.int64, device="cuda"))
        want = torch.tensor([[r] * 3 for r in range(n) for _ in range(r + 1)], dtype=torch.int64)
        ok.append(a.is_cuda and torch.equal(a.cpu(), want))
        if n == 1:  # NCCL (one GPU per rank) for the rest: a world of one
            b = torch.full((5,), 3.0, device="cuda")
            hvd.broadcast_(b, root_rank=0)
            ok.append(torch.equal(b.cpu(), torch.full((5,), 3.0)))
            avg = hvd.allreduce(torch.full((7,), 5, dtype=torch.int32, device="cuda"), op=hvd.Average)
            ok.append(avg.is_cuda and avg.cpu().tolist() == [5] * 7)
        return ok
    finally:
        hvd.shutdown()


def test_horovod_cuda_world_of_one():
    assert run_ranks(_horovod_cuda, 1, RUN_TIMEOUT, start_method="spawn") == [[True] * 5]


def test_horovod_cuda_two_ranks_sharing_one_gpu():
    assert run_ranks(_horovod_cuda, 2, RUN_TIMEOUT, start_method="spawn") == [[True] * 3] * 2
