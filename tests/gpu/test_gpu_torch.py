"""The torch backend with CUDA tensors (one rank on one GPU): all_reduce, reduce_scatter_tensor,
all_gather_into_tensor, broadcast, reduce and all_to_all(_single) on torch's current stream,
synchronous and async, exact values; send/recv with a GPU per rank."""

import pytest

from conftest import run_ranks
from gpu_util import RUN_TIMEOUT, skip_reason

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))]


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
    assert run_ranks(_torch_cuda, 1, RUN_TIMEOUT, start_method="spawn") == [[True, True, True, True]]


def _torch_cuda_more(rank, n, store):
    import torch
    import torch.distributed as dist

    import plait.torch  # noqa: F401

    torch.cuda.set_device(rank)
    dist.init_process_group("plait", store=dist.HashStore(), rank=rank, world_size=n)
    try:
        ok = []
        x = torch.arange(1001, dtype=torch.int32, device="cuda")
        dist.broadcast(x, src=0)
        ok.append(torch.equal(x.cpu(), torch.arange(1001, dtype=torch.int32)))
        y = torch.arange(999, dtype=torch.float64, device="cuda")
        dist.reduce(y, dst=0, op=dist.ReduceOp.SUM, async_op=True).wait()
        ok.append(torch.equal(y.cpu(), torch.arange(999, dtype=torch.float64)))
        z = torch.arange(12, dtype=torch.int16, device="cuda")  # not a plait dtype: moved as bytes
        out = torch.empty_like(z)
        dist.all_to_all_single(out, z)
        ok.append(torch.equal(out.cpu(), torch.arange(12, dtype=torch.int16)))
        outs = [torch.empty(5, dtype=torch.bfloat16, device="cuda")]
        dist.all_to_all(outs, [torch.full((5,), 3, dtype=torch.bfloat16, device="cuda")])
        ok.append(bool((outs[0].cpu() == 3).all()))
        return ok
    finally:
        dist.destroy_process_group()


def test_torch_cuda_broadcast_reduce_alltoall_world_of_one():
    assert run_ranks(_torch_cuda_more, 1, RUN_TIMEOUT, start_method="spawn") == [[True] * 4]


def _torch_cuda_p2p(rank, n, store, port):
    import torch
    import torch.distributed as dist

    import plait.torch  # noqa: F401

    torch.cuda.set_device(rank)
    tcp = dist.TCPStore("127.0.0.1", port, n, rank == 0)
    dist.init_process_group("plait", store=tcp, rank=rank, world_size=n)
    try:
        dist.broadcast(torch.zeros(1, device="cuda"), src=0)  # creates the GPU communicator
        if rank == 0:
            dist.send(torch.arange(777, dtype=torch.int64, device="cuda"), dst=1)
            return True
        got = torch.empty(777, dtype=torch.int64, device="cuda")
        dist.recv(got, src=0)
        return torch.equal(got.cpu(), torch.arange(777, dtype=torch.int64))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(skip_reason(2) is not None, reason=str(skip_reason(2)))
def test_torch_cuda_send_recv_gpu_per_rank():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert run_ranks(_torch_cuda_p2p, 2, RUN_TIMEOUT, args=(port,), start_method="spawn") == [True, True]


def _torch_stream_order(rank, n, store):
    import torch
    import torch.distributed as dist

    import plait.torch  # noqa: F401
    from gpu_util import gpu_sleep_cycles

    torch.cuda.set_device(rank)
    dist.init_process_group("plait", store=dist.HashStore(), rank=rank, world_size=n)
    try:
        base = torch.arange(1 << 16, dtype=torch.float32)
        x = base.cuda()
        dist.all_reduce(x)  # creates the GPU communicator
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(gpu_sleep_cycles(1))  # the collective queues behind a second of work
            work = dist.all_reduce(x, async_op=True)
        fut = work.get_future().then(lambda f: f.value()[0] * 2)
        work.wait()  # the current (default) stream waits for the collective; the host does not
        host_went_on = not side.query() and not torch.cuda.current_stream().query()
        doubled = fut.wait()  # CUDA-aware: ordered after the collective on this stream
        return [
            host_went_on,
            torch.equal(x.cpu(), base * n * n),
            torch.equal(doubled.cpu(), base * n * n * 2),
        ]
    finally:
        dist.destroy_process_group()


def test_torch_cuda_work_wait_is_stream_ordered():
    """Work.wait() and the Future of a CUDA op follow torch's NCCL semantics: stream waits, not
    host waits, and the values seen through them are the collective's."""
    assert run_ranks(_torch_stream_order, 1, RUN_TIMEOUT, start_method="spawn") == [[True, True, True]]
