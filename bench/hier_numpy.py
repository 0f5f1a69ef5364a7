"""plait's numpy allreduce across simulated hosts against torch's flat gloo, in one run.

    plait-run -n 2 python bench/hier_numpy.py --hosts 2     # 2 simulated hosts x 1 rank
    plait-run -n 4 python bench/hier_numpy.py --hosts 2     # 2 simulated hosts x 2 ranks

Each rank sets PLAIT_HOST_ID to its host (ranks split in order) before plait.init, so plait takes
its multi-host path (csrc/hier) over gloo between the simulated hosts, while a gloo process
group runs flat over every rank. For each size (float32 sum) it times the sync call and
async_op=True + wait() on both, batches alternating so the machine's drift hits both alike, and
prints on rank 0 the slowest rank's median batch time of each and the ratio plait / gloo. The
numpy twin of bench/hier_torch.py: no torch backend between the caller and the communicator.
"""

import argparse
import os
import time

import numpy as np


def _calls(comm, dist, x, t):
    return {
        ("plait", "sync"): lambda: comm.allreduce(x, out=x),
        ("gloo", "sync"): lambda: dist.all_reduce(t),
        ("plait", "async"): lambda: comm.allreduce(x, out=x, async_op=True).wait(),
        ("gloo", "async"): lambda: dist.all_reduce(t, async_op=True).wait(),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2, help="simulated hosts (ranks split in order)")
    ap.add_argument("--sizes", default="8,262144,16777216", help="bytes, comma separated")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per timed batch (sets iterations)")
    a = ap.parse_args(argv)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if n % a.hosts:
        raise SystemExit(f"{n} ranks do not split evenly over {a.hosts} hosts")
    os.environ["PLAIT_HOST_ID"] = f"bench-host{rank // (n // a.hosts)}"

    import torch
    import torch.distributed as dist

    import plait

    comm = plait.init(timeout=120)
    dist.init_process_group("gloo")
    rows = []
    for size in (int(s) for s in a.sizes.split(",")):
        x = np.ones(max(1, size // 4), dtype=np.float32)
        t = torch.from_numpy(x.copy())
        calls = _calls(comm, dist, x, t)
        for fn in calls.values():  # warm up
            for _ in range(3):
                fn()
        t0 = time.perf_counter()
        calls[("gloo", "sync")]()
        iters = np.array([max(3, min(2000, int(a.budget / max(time.perf_counter() - t0, 1e-6))))])
        comm.broadcast(iters, 0)  # every rank runs the same number of calls
        iters = int(iters[0])
        times = {k: [] for k in calls}
        for _ in range(a.batches):
            for k, fn in calls.items():
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[k].append((time.perf_counter() - t0) / iters * 1e6)
        med = np.array([sorted(times[k])[len(times[k]) // 2] for k in calls])
        comm.allreduce(med, out=med, op="max")  # the slowest rank's median is the call's time
        # one checked call per size: integer-valued data, closed-form sum
        y = (np.arange(x.size) % 97).astype(np.float32) * (rank + 1)
        comm.allreduce(y, out=y)
        want = (np.arange(x.size) % 97).astype(np.float32) * (n * (n + 1) // 2)
        wrong = comm.allreduce(np.array([int((y != want).sum())]))
        rows.append((size, dict(zip(calls, med)), iters, int(wrong[0])))
    if rank == 0:
        print(f"# {n} ranks on {a.hosts} simulated hosts, numpy float32 sum, plait vs flat gloo")
        print("| bytes | iters | plait sync (us) | gloo sync | ratio ", end="")
        print("| plait async+wait | gloo async+wait | ratio | #wrong |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for size, m, iters, wrong in rows:
            ps, gs = m[("plait", "sync")], m[("gloo", "sync")]
            pa, ga = m[("plait", "async")], m[("gloo", "async")]
            print(f"| {size} | {iters} | {ps:.0f} | {gs:.0f} | {ps / gs:.2f} ", end="")
            print(f"| {pa:.0f} | {ga:.0f} | {pa / ga:.2f} | {wrong} |")
    dist.destroy_process_group()
    comm.finalize()


if __name__ == "__main__":
    main()
