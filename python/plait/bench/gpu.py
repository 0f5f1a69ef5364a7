"""plait-bench --device cuda: one rank's GPU sweep, plait's own GPU algorithms against NCCL's.

Each rank uses GPU LOCAL_RANK % devices. With a GPU per rank the algorithms are NCCL's and
plait's over NCCL (nccl, ring, tree); with more ranks than GPUs (or PLAIT_GPU_TRANSPORT=ipc)
they are plait's over CUDA IPC (one_shot), since NCCL refuses two ranks on one GPU.
Every (collective, size, algorithm) is timed over `iters` calls on the current stream with one
synchronisation at the end, after warm-up, median of --trials (iters: --iters, else as many as fit
--time, 1..200); the last call's output is checked against closed-form values (#wrong). The sizes
always end at --maxbytes. Rank 0 first times a device-to-device copy of the largest size alone
(the bound a one-GPU transport's busbw is judged against) and prints an nccl-tests-style table.
"""

import os
import statistics
import time

import numpy as np

BUSBW = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
}


class _Arrays:
    """Device arrays through cupy or torch, whichever can use the GPU."""

    def __init__(self, device):
        try:
            import cupy

            cupy.cuda.Device(device).use()
            cupy.zeros(1)
            self.cupy, self.torch = cupy, None
        except Exception:  # noqa: BLE001 - no cupy, or a cupy that cannot run here
            import torch

            torch.cuda.set_device(device)
            self.cupy, self.torch = None, torch

    def put(self, a):
        return self.cupy.asarray(a) if self.cupy is not None else self.torch.from_numpy(a).cuda()

    def empty(self, count, dtype):
        if self.cupy is not None:
            return self.cupy.empty(count, dtype=dtype)
        return self.torch.empty(count, dtype=getattr(self.torch, np.dtype(dtype).name), device="cuda")

    def get(self, x):
        return self.cupy.asnumpy(x) if self.cupy is not None else x.cpu().numpy()

    def copy(self, dst, src):
        if self.cupy is not None:
            self.cupy.copyto(dst, src)
        else:
            dst.copy_(src)

    def sync(self):
        if self.cupy is not None:
            self.cupy.cuda.get_current_stream().synchronize()
        else:
            self.torch.cuda.current_stream().synchronize()


def _case(coll, count, rank, n, dtype):
    """(input, expected output) of `count` elements per block, integer-valued and exact."""

    def block(r):
        return ((np.arange(count) % 7) + r).astype(dtype)

    if coll == "allgather":
        return block(rank), np.concatenate([block(r) for r in range(n)])
    total = sum(block(r).astype(np.float64) for r in range(n)).astype(dtype)
    if coll == "allreduce":
        return block(rank), total
    full = np.concatenate([np.roll(block(rank), b) for b in range(n)])
    return full, np.roll(total, rank)


def _copy_limit(xp, comm, nbytes, dtype):
    """GB/s of one device-to-device copy of nbytes on rank 0's GPU, the other ranks idle."""
    t, count = 0.0, max(1, nbytes // dtype.itemsize)
    if comm.rank == 0:
        src, dst = xp.empty(count, dtype), xp.empty(count, dtype)
        xp.copy(dst, src)
        xp.sync()
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            xp.copy(dst, src)
        xp.sync()
        t = (time.perf_counter() - t0) / reps
        del src, dst
    comm.barrier()
    return count * dtype.itemsize / t / 1e9 if t else 0.0  # rank 0 prints it


def _iters_for(call, x, out, algo, kw, xp, comm, budget_s):
    """As many calls as fit budget_s by one timed call (the same on every rank: the slowest's)."""
    t0 = time.perf_counter()
    call(x, out=out, algorithm=algo, **kw)
    xp.sync()
    dt = np.array([time.perf_counter() - t0])
    comm.allreduce(dt, dt, op="max")
    return int(min(200, max(1, budget_s / max(dt[0], 1e-7))))


def run_gpu_rank(args):
    import plait
    from plait import _C

    if not plait.build_info()["cuda"]:
        raise SystemExit("plait-bench --device cuda: this plait build has no CUDA path")
    ndev = _C.cuda_device_count()
    if ndev < 1:
        raise SystemExit("plait-bench --device cuda: no CUDA device is visible")
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    xp = _Arrays(local % ndev)
    comm = plait.init()
    rank, n = comm.rank, comm.size
    transport = os.environ.get("PLAIT_GPU_TRANSPORT", "auto")
    shared = int(os.environ.get("LOCAL_WORLD_SIZE", n)) > ndev  # some ranks share a GPU
    chosen = _C.select_transport(device_buffers=True, shared_gpu=shared, prefer=transport) or "nccl"
    ipc = chosen == "ipc"

    def listed(coll):
        return _C.algorithms(coll, chosen)

    dtype = np.dtype(args.dtype)
    sizes = list(args.sizes) + ([args.maxbytes] if args.sizes[-1] != args.maxbytes else [])
    limit = _copy_limit(xp, comm, max(sizes), dtype)
    rows = []
    for coll in [c for c in args.collectives if c in BUSBW]:
        algos = listed(coll) if args.algorithm in ("all", "auto") else args.algorithm.split(",")
        for nbytes in sizes:
            count = max(1, nbytes // dtype.itemsize // (n if coll == "reduce_scatter" else 1))
            inp, want = _case(coll, count, rank, n, dtype)
            x = xp.put(inp)
            for algo in algos:
                out = xp.empty(want.size, dtype)
                call = getattr(comm, coll)
                kw = {} if coll == "allgather" else {"op": "sum"}
                for _ in range(max(1, args.warmup)):
                    call(x, out=out, algorithm=algo, **kw)
                xp.sync()
                iters = args.iters or _iters_for(
                    call, x, out, algo, kw, xp, comm, args.time / max(1, args.trials)
                )
                times = []
                for _ in range(args.trials):
                    comm.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        call(x, out=out, algorithm=algo, **kw)
                    xp.sync()
                    times.append((time.perf_counter() - t0) / iters)
                wrong = int(np.count_nonzero(xp.get(out) != want))
                t = statistics.median(times)
                size = count * dtype.itemsize * (n if coll != "allreduce" else 1)
                algbw = size / t / 1e9
                rows.append((coll, size, algo, t * 1e6, algbw, algbw * BUSBW[coll](n), wrong))
    if rank == 0:
        print(
            f"# plait-bench --device cuda: {n} rank(s) on {min(n, ndev)} GPU(s), "
            f"{'CUDA IPC' if ipc else 'NCCL ' + str(plait.build_info()['nccl'])}, {args.dtype}"
        )
        print(
            f"# copy limit: device-to-device copy of {max(sizes)} bytes on one GPU: {limit:.1f} GB/s "
            f"(bytes copied per second; each byte is read and written)"
        )
        print(
            f"{'collective':>15} {'bytes':>12} {'algorithm':>9} {'time(us)':>10} {'algbw(GB/s)':>12} "
            f"{'busbw(GB/s)':>12} {'#wrong':>7}"
        )
        for coll, size, algo, us, algbw, busbw, wrong in rows:
            print(f"{coll:>15} {size:>12} {algo:>9} {us:>10.1f} {algbw:>12.2f} {busbw:>12.2f} {wrong:>7}")
    comm.finalize()
    return 1 if any(r[-1] for r in rows) else 0
