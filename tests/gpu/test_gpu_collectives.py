"""GPU collectives with exact values: every collective x dtype x op x algorithm (nccl, ring, tree
over NCCL; one_shot, two_shot and ring over CUDA IPC), in place and not, multi-chunk
(PLAIT_GPU_CHUNK_BYTES=4096, PLAIT_GPU_IPC_BYTES=8192) and unaligned. World size 1 needs one GPU;
NCCL with 2-4 ranks needs a GPU per rank (NCCL refuses two ranks on one GPU); the IPC transport
runs 2-4 ranks on one GPU.
Ranks are spawned, not forked (CUDA)."""

import pytest

from conftest import run_ranks
from gpu_util import DEVICES, DTYPES, RUN_TIMEOUT, Device, data, expected, ops_for, skip_reason

pytestmark = pytest.mark.cuda
ENV = {"PLAIT_GPU_CHUNK_BYTES": "4096", "PLAIT_GPU_IPC_BYTES": "8192"}
COUNTS = (1, 1027, 5000)  # one element; odd (vector tail); several 4 KiB chunks per block


def _sweep(rank, n, store, colls, algos, one_gpu=False, counts=COUNTS, dtypes=DTYPES):
    import os

    import numpy as np

    import plait
    from plait import _C

    dev = Device(0 if one_gpu else rank)
    comm = plait.init(rank, n, store=store)
    # Both transports have a "ring": the names this world's transport has.
    transport = "ipc" if one_gpu or os.environ.get("PLAIT_GPU_TRANSPORT") == "ipc" else "nccl"

    def listed(coll):
        return _C.algorithms(coll, transport)

    bad, runs = [], 0
    for coll in colls:
        for algo in algos:
            if algo not in listed(coll):
                continue
            for dtype in dtypes:
                for op in ops_for(dtype) if coll != "allgather" else ("sum",):
                    for count in counts:
                        for in_place in (False, True):
                            runs += 1
                            what = f"{coll}/{algo}/{dtype}/{op}/count {count}/in_place {in_place}"
                            got, want = _one(comm, dev, coll, algo, dtype, op, count, in_place, rank, n)
                            if got.shape != want.shape or not np.array_equal(got, want):
                                diff = (
                                    np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:3]
                                    if got.shape == want.shape
                                    else []
                                )
                                bad.append(
                                    f"rank {rank}: {what}: first differences at {list(diff)}: "
                                    f"got {got.reshape(-1)[:4]}, want {want.reshape(-1)[:4]}"
                                )
    return runs, bad[:10]


def _one(comm, dev, coll, algo, dtype, op, count, in_place, rank, n):
    import numpy as np

    if coll == "allreduce":
        x, dt = dev.put(data(dtype, op, rank, n, count))
        out = x if in_place else dev.empty(x, count)
        comm.allreduce(x, out=out, op=op, algorithm=algo, dtype=dt)
        return dev.get(out, dtype), expected(dtype, op, n, count)
    if coll == "reduce_scatter":
        # Block b of rank r's input is data(..., count) shifted by b, so blocks differ.
        host = np.concatenate([np.roll(data(dtype, op, rank, n, count), b) for b in range(n)])
        x, dt = dev.put(host)
        out = x[rank * count : (rank + 1) * count] if in_place else dev.empty(x, count)
        comm.reduce_scatter(x, out=out, op=op, algorithm=algo, dtype=dt)
        return dev.get(out, dtype), np.roll(expected(dtype, op, n, count), rank)
    whole, dt = dev.put(np.zeros(n * count, dtype=data(dtype, op, 0, n, 1).dtype))
    mine = data(dtype, op, rank, n, count)
    if in_place:
        x = whole[rank * count : (rank + 1) * count]
        if isinstance(x, np.ndarray):
            x[:] = mine.view(x.dtype)  # host arrays: lets the harness itself be checked on CPU
        elif hasattr(x, "copy_"):
            x.copy_(dev.put(mine)[0])
        else:
            x.set(dev.put(mine)[0].get())
    else:
        x = dev.put(mine)[0]
    comm.allgather(x, out=whole, algorithm=algo, dtype=dt)
    return dev.get(whole, dtype), np.concatenate([data(dtype, op, r, n, count) for r in range(n)])


def _check(results):
    runs = sum(r for r, _ in results)
    assert runs > 0
    bad = [line for _, lines in results for line in lines]
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
@pytest.mark.parametrize("coll", ["allreduce", "reduce_scatter", "allgather"])
@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_world_of_one(coll, transport):
    algos = ["nccl", "ring", "tree"] if transport == "nccl" else ["one_shot", "two_shot", "ring"]
    _check(
        run_ranks(
            _sweep,
            1,
            RUN_TIMEOUT,
            args=([coll], algos),
            env=dict(ENV, PLAIT_GPU_TRANSPORT=transport),
            start_method="spawn",
        )
    )


# Every dtype at n = 2; n = 3 and 4 (time-sliced on one GPU, so slower) take one dtype of each
# element size and kind, and fewer counts.
SHORT_DTYPES = ("float16", "bfloat16", "float32", "int8", "int64", "bool")


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ipc_ranks_sharing_one_gpu(n):
    counts, dtypes = (COUNTS, DTYPES) if n == 2 else ((1, 1027), SHORT_DTYPES)
    _check(
        run_ranks(
            _sweep,
            n,
            RUN_TIMEOUT,
            args=(
                ["allreduce", "reduce_scatter", "allgather"],
                ["one_shot", "two_shot", "ring"],
                True,
                counts,
                dtypes,
            ),
            env=ENV,
            start_method="spawn",
        )
    )


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ipc_ring_small_counts_and_epoch_handoff(n):
    # Fewer elements than ranks leaves empty allreduce blocks that still post their epochs; the
    # one_shot and two_shot calls between ring calls on one communicator check the epoch handoff.
    _check(
        run_ranks(
            _sweep,
            n,
            RUN_TIMEOUT,
            args=(
                ["allreduce", "reduce_scatter", "allgather"],
                ["ring", "one_shot", "ring", "two_shot"],
                True,
                (0, 1, 2, 3, 7, 2049),
                SHORT_DTYPES,
            ),
            env=ENV,
            start_method="spawn",
        )
    )


@pytest.mark.skipif(skip_reason(2) is not None, reason=str(skip_reason(2)))
@pytest.mark.parametrize("n", sorted({2, min(4, max(DEVICES, 2))}))
@pytest.mark.parametrize("algo", ["nccl", "ring", "tree"])
def test_one_gpu_per_rank(n, algo):
    _check(
        run_ranks(
            _sweep,
            n,
            RUN_TIMEOUT,
            args=(["allreduce", "reduce_scatter", "allgather"], [algo]),
            env=ENV,
            start_method="spawn",
        )
    )


def _unaligned_and_async(rank, n, store):
    import numpy as np

    import plait

    dev = Device(rank)
    comm = plait.init(rank, n, store=store)
    host = data("float32", "sum", rank, n, 4099)
    big, _ = dev.put(host)
    x = big[1:]  # 4-byte offset: the kernels' scalar path
    out = dev.empty(x, 4098)
    got = comm.allreduce(x, out=out, algorithm="ring", async_op=True).wait(timeout=60)
    return bool(np.array_equal(dev.get(got, "float32"), expected("float32", "sum", n, 4099)[1:]))


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
def test_unaligned_and_async_world_of_one():
    assert run_ranks(_unaligned_and_async, 1, RUN_TIMEOUT, env=ENV, start_method="spawn") == [True]


def _same_gpu(rank, n, store):
    import numpy as np

    import plait

    dev = Device(0)
    comm = plait.init(rank, n, store=store)
    x, _ = dev.put(np.ones(8, np.float32))
    try:
        comm.allreduce(x)
    except plait.InvalidArgument as e:
        return str(e)
    return "no error"


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
def test_nccl_forced_on_one_gpu_is_refused_clearly():
    for rank, msg in enumerate(
        run_ranks(_same_gpu, 2, RUN_TIMEOUT, env={"PLAIT_GPU_TRANSPORT": "nccl"}, start_method="spawn")
    ):
        assert "same GPU" in msg and "ranks 0 and 1" in msg, f"rank {rank}: {msg}"


def _mix(rank, n, store, case):
    import numpy as np

    import plait

    dev = Device(rank)
    comm = plait.init(rank, n, store=store)
    x, _ = dev.put(np.ones(8, np.float32))
    try:
        if case == "host_out":
            comm.allreduce(x, out=np.zeros(8, np.float32))
        else:
            comm.allreduce(x, out=Device(1 - rank).empty(x, 8))
    except plait.InvalidArgument as e:
        return str(e)
    return "no error"


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
def test_host_output_for_gpu_input_is_refused():
    (msg,) = run_ranks(_mix, 1, RUN_TIMEOUT, args=("host_out",), start_method="spawn")
    assert "host array" in msg and "float32 x 8" in msg, msg


@pytest.mark.skipif(skip_reason(2) is not None, reason=str(skip_reason(2)))
def test_arrays_on_two_gpus_are_refused():
    for msg in run_ranks(_mix, 2, RUN_TIMEOUT, args=("two_gpus",), start_method="spawn"):
        assert "input on GPU" in msg and "output on GPU" in msg, msg


def _late(rank, n, store, one_gpu, algo, mode):
    """Both ranks agree on the call (the host fingerprint passes), then rank 1's GPU stalls
    (torch.cuda._sleep ahead of the collective on its stream): rank 0's GPU side must give up on
    the deadline (IPC: the wait kernel, or the watchdog's abort word; NCCL: the watchdog's
    ncclCommAbort), and the error must reach rank 1 too. mode "sync": rank 0 issues the call
    without a handle and then synchronises the device, which must not hang."""
    import time

    import numpy as np

    import plait
    from gpu_util import gpu_sleep_cycles

    dev = Device(0 if one_gpu else rank)
    torch = dev.torch
    comm = plait.init(rank, n, store=store)
    x, _ = dev.put(np.ones(1 << 20, np.float32))
    comm.allreduce(x, out=x)  # creates the GPU communicator on both ranks
    dev.get(x, "float32")
    if rank == 1:
        torch.cuda._sleep(gpu_sleep_cycles(8))  # joins the call on the host, 8 s late on the GPU
    t0 = time.monotonic()
    try:
        if mode == "async":
            comm.allreduce(x, out=x, algorithm=algo, timeout=2, async_op=True).wait()
        else:
            comm.allreduce(x, out=x, algorithm=algo, timeout=2)
            torch.cuda.synchronize()  # the watchdog (or the wait kernel) must end the GPU work
            comm.allreduce(x, out=x, algorithm=algo, timeout=2)  # raises the error it recorded
    except plait.PlaitError as e:
        took = time.monotonic() - t0
        torch.cuda.synchronize()
        return f"{took:.1f} {type(e).__name__} {e}"
    torch.cuda.synchronize()
    return "no error"


def _check_late(results):
    first, second = results
    took, cls, msg = first.split(" ", 2)
    assert float(took) < 60 and cls == "TimeoutError", first
    # The GPU side gave up (not the host fingerprint, whose message lists the ranks not arrived).
    assert "communicator aborted" in msg and "have not arrived" not in msg, first
    assert "deadline" in msg or "gave up" in msg, first
    assert second != "no error" and "aborted" in second, f"rank 1 must learn of the abort: {second}"


@pytest.mark.skipif(skip_reason(2) is not None, reason=str(skip_reason(2)))
@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("algo", ["nccl", "ring"])
def test_a_missing_peer_times_out_and_aborts_nccl(algo, mode):
    _check_late(run_ranks(_late, 2, RUN_TIMEOUT, args=(False, algo, mode), start_method="spawn"))


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("algo", ["one_shot", "ring"])  # ring: its waits are on one neighbour each
def test_a_missing_peer_times_out_and_aborts_ipc(algo, mode):
    _check_late(run_ranks(_late, 2, RUN_TIMEOUT, args=(True, algo, mode), start_method="spawn"))
