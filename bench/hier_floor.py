"""The floor of a hierarchical allreduce over gloo on this machine: flat gloo against the inter-host
step alone, in one job.

    plait-run -n 4 python bench/hier_floor.py          # 2 simulated hosts x 2 ranks

A hierarchical allreduce over 2 hosts x L ranks (plait's uniform layout, NCCL's and Horovod's)
reduces inside each host, then runs L engine allreduces at once, each over one rank of every host
on 1/L of the data, then gathers inside each host. Whatever the local steps cost, it cannot beat
its inter-host step alone. This times that step by itself: the L shard groups' gloo allreduces of
size/L bytes, all at once, against one flat gloo allreduce of the whole size over every rank
(float32 sum, in place), in alternating batches. The ratio step / flat is the least
plait / flat gloo that any design riding on gloo can reach here (issue 26 asks 0.3 at 8 B and 0.6
at 16 MiB on 2 x 2). Rank 0 prints the slowest rank's median batch per call. Results:
bench/RESULTS-hier.md.
"""

import argparse
import os
import statistics
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2, help="simulated hosts (ranks split in order)")
    ap.add_argument("--sizes", default="8,16777216", help="bytes, comma separated")
    ap.add_argument("--batches", type=int, default=9)
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per timed batch")
    a = ap.parse_args(argv)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if n % a.hosts or n == a.hosts:
        raise SystemExit(f"{n} ranks: give each of {a.hosts} hosts the same number, at least 2")
    per = n // a.hosts  # L, ranks per host; host h holds ranks h*L .. h*L+L-1

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    # shard group i: local rank i of every host (every rank creates every group, in one order)
    shards = [dist.new_group([h * per + i for h in range(a.hosts)]) for i in range(per)]
    mine = shards[rank % per]
    if rank == 0:
        print(f"# {n} ranks = {a.hosts} hosts x {per}, torch {torch.__version__}, gloo, float32 sum")
        print("| bytes | flat gloo (us) | inter-host step alone (us) | step / flat |")
        print("|---:|---:|---:|---:|")
    for nbytes in (int(s) for s in a.sizes.split(",")):
        count = max(1, nbytes // 4)
        flat_t = torch.ones(count)
        part = torch.ones(max(1, count // per))
        runs = {
            "flat": lambda t=flat_t: dist.all_reduce(t),
            "step": lambda t=part: dist.all_reduce(t, group=mine),
        }
        iters = {}
        for name, fn in runs.items():  # calibrate: calls per batch within the budget
            fn()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            one = time.perf_counter() - t0
            got = torch.tensor([max(1, min(2000, int(a.budget / max(one, 1e-6))))])
            dist.all_reduce(got, op=dist.ReduceOp.MIN)
            iters[name] = int(got)
        times = {k: [] for k in runs}
        for b in range(a.batches):
            order = list(runs) if b % 2 == 0 else list(reversed(list(runs)))
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters[name]):
                    runs[name]()
                per_call = torch.tensor([(time.perf_counter() - t0) / iters[name]])
                dist.all_reduce(per_call, op=dist.ReduceOp.MAX)  # the slowest rank's
                times[name].append(float(per_call))
        # the sums are exact small integers: check once
        flat_t.fill_(1.0)
        part.fill_(1.0)
        runs["flat"]()
        runs["step"]()
        assert float(flat_t[0]) == n and float(part[0]) == a.hosts, (float(flat_t[0]), float(part[0]))
        if rank == 0:
            f, s = (statistics.median(times[k]) * 1e6 for k in ("flat", "step"))
            print(f"| {nbytes} | {f:.0f} | {s:.0f} | {s / f:.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
