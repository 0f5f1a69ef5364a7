"""plait's GPU allreduce next to NCCL's own, as torch.distributed runs it (ProcessGroupNCCL).

    plait-run -n N bench/gpu_vs_nccl.py [sizes in bytes, comma-separated] [trials]

Each rank takes GPU LOCAL_RANK % devices. Per size, rank 0 prints the latency (us per call) and
busbw (GB/s, nccl-tests' 2(n-1)/n) of plait's auto choice and of each of its allreduce algorithms,
and of torch's NCCL allreduce, side by side: the issue-23 targets are busbw >= 0.9x NCCL's at
64 MiB and latency <= NCCL's at 8 B (IPC one_shot). With ranks sharing a GPU NCCL cannot run
(it refuses two ranks on one GPU): its column reads "-" and plait runs over CUDA IPC. Every
timing is median of `trials`, each over as many calls as fit ~0.2 s on the current stream with
one synchronisation; outputs are checked once per size against the closed form (#wrong).
"""

import os
import statistics
import sys
import time


def _timed(fn, sync, target_s=0.2):
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, min(500, int(target_s / one)))
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _caller(comm, x, y, algo):
    return lambda: comm.allreduce(x, out=y, algorithm=algo)


def _caller_torch(dist, z, pg):
    return lambda: dist.all_reduce(z, group=pg)


def main():
    sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "8,4096,1048576,67108864").split(",")]
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    import torch
    import torch.distributed as dist

    import plait

    comm = plait.init()
    n, rank = comm.size, comm.rank
    dev = int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count())
    torch.cuda.set_device(dev)
    uuids = comm.allgather(torch.tensor([dev], dtype=torch.int64).numpy())
    shared = len({int(u[0]) for u in uuids}) < n
    pg = None
    if not shared:
        dist.init_process_group("nccl", rank=rank, world_size=n, device_id=torch.device("cuda", dev))
        pg = dist.group.WORLD
    # The rows of the transport these ranks get (another one's names would abort the communicator).
    algos = ["auto"] + list(plait._C.algorithms("allreduce", "ipc" if shared else "nccl"))
    sync = torch.cuda.synchronize
    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        x = torch.full((count,), float(rank + 1), device="cuda")
        y = torch.empty_like(x)
        want = n * (n + 1) / 2
        row = {"bytes": count * 4}
        for algo in algos:
            comm.allreduce(x, out=y, algorithm=None if algo == "auto" else algo)
            sync()
            wrong = int((y != want).sum())
            call = _caller(comm, x, y, None if algo == "auto" else algo)
            row[algo] = (statistics.median(_timed(call, sync) for _ in range(trials)), wrong)
        if pg is not None:
            z = torch.zeros_like(x)
            call = _caller_torch(dist, z, pg)
            row["torch-nccl"] = (statistics.median(_timed(call, sync) for _ in range(trials)), 0)
        rows.append(row)
    if rank == 0:
        cols = algos + (["torch-nccl"] if pg is not None else [])
        factor = 2 * (n - 1) / n if n > 1 else 1.0
        print(f"# allreduce float32, {n} ranks, {'shared GPU (IPC)' if shared else 'a GPU per rank'}")
        print("#" + "".join(f"{c:>22}" for c in ["bytes"] + cols))
        print("#" + "".join(f"{'':>22}" for _ in [0]) + "".join(f"{'us / GB/s / #wrong':>22}" for _ in cols))
        for row in rows:
            cells = [f"{row['bytes']:>22}"]
            for c in cols:
                t, w = row.get(c, (None, "-"))
                cell = "-" if t is None else f"{t * 1e6:.1f} / {row['bytes'] * factor / t / 1e9:.2f} / {w}"
                cells.append(f"{cell:>22}")
            print(" " + "".join(cells))
    comm.finalize()
    if pg is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
