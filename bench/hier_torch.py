"""dist.all_reduce on a "plait" group whose ranks span hosts, against flat gloo, in one run.

    plait-run -n 2 bench/hier_torch.py --hosts 2      # 2 simulated hosts x 1 rank
    plait-run -n 4 bench/hier_torch.py --hosts 2      # 2 simulated hosts x 2 ranks

Each rank sets PLAIT_HOST_ID to its host (ranks split in order: with -n 4 --hosts 2, ranks 0-1
are host 0, 2-3 host 1) before the groups are made, so plait takes its multi-host path over
gloo between the simulated hosts while gloo runs flat over every rank. For each size (float32
sum; 8 B, 256 KiB, 16 MiB by default) it times the sync call and async_op=True + wait() on both
groups, batches alternating between them so the machine's drift hits both alike, and prints on
rank 0 the median batch time of each and the ratio plait / gloo (the issue's targets: <= 1.15x
at 8 B and <= 1.05x at 256 KiB and 16 MiB with 1 rank per host; <= 0.3x at 8 B and <= 0.6x at
16 MiB with 2 ranks per host). Results: bench/RESULTS-hier.md.
"""

import argparse
import os
import time


def _batch(dist, fn, iters):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def _calls(dist, t, group):
    def sync():
        dist.all_reduce(t, group=group)

    def asyn():
        dist.all_reduce(t, group=group, async_op=True).wait()

    return sync, asyn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2, help="simulated hosts (ranks split in order)")
    ap.add_argument("--sizes", default="8,262144,16777216", help="bytes, comma separated")
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per timed batch (sets iterations)")
    a = ap.parse_args(argv)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if n % a.hosts:
        raise SystemExit(f"{n} ranks do not split evenly over {a.hosts} hosts")
    os.environ["PLAIT_HOST_ID"] = f"bench-host{rank // (n // a.hosts)}"

    import torch
    import torch.distributed as dist

    import plait.torch  # noqa: F401  (registers "plait")

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    plait_pg = dist.new_group(backend="plait")
    gloo_pg = dist.new_group(backend="gloo")
    rows = []
    for size in (int(s) for s in a.sizes.split(",")):
        t = torch.ones(max(1, size // 4), dtype=torch.float32)
        calls = {"plait": _calls(dist, t, plait_pg), "gloo": _calls(dist, t, gloo_pg)}
        for sync, asyn in calls.values():  # warm up; also sets the iteration count
            for _ in range(3):
                sync()
                asyn()
        t0 = time.perf_counter()
        calls["gloo"][0]()
        one = time.perf_counter() - t0
        iters = torch.tensor([max(3, min(2000, int(a.budget / max(one, 1e-6))))])
        dist.broadcast(iters, 0)  # every rank runs the same number of calls
        iters = int(iters)
        times = {(g, k): [] for g in calls for k in ("sync", "async")}
        for _ in range(a.batches):
            for g, (sync, asyn) in calls.items():
                times[(g, "sync")].append(_batch(dist, sync, iters))
                times[(g, "async")].append(_batch(dist, asyn, iters))
        # the slowest rank's median is the call's time
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        vec = torch.tensor([med[k] for k in sorted(med)], dtype=torch.float64)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        med = dict(zip(sorted(med), vec.tolist()))
        # one checked call per size: integer-valued data, closed-form sum
        x = (torch.arange(t.numel(), dtype=torch.float32) % 97) * (rank + 1)
        dist.all_reduce(x, group=plait_pg)
        want = (torch.arange(t.numel(), dtype=torch.float32) % 97) * (n * (n + 1) // 2)
        wrong = torch.tensor([int((x != want).sum())])
        dist.all_reduce(wrong)
        rows.append((size, med, iters, int(wrong)))
    if rank == 0:
        print(f"# {n} ranks on {a.hosts} simulated hosts, torch {torch.__version__}, float32 sum")
        print(
            "| bytes | iters | plait sync (us) | gloo sync | ratio "
            "| plait async+wait | gloo async+wait | ratio | #wrong |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for size, m, iters, wrong in rows:
            ps, gs = m[("plait", "sync")], m[("gloo", "sync")]
            pa, ga = m[("plait", "async")], m[("gloo", "async")]
            print(
                f"| {size} | {iters} | {ps:.0f} | {gs:.0f} | {ps / gs:.2f} "
                f"| {pa:.0f} | {ga:.0f} | {pa / ga:.2f} | {wrong} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
