"""The multi-host check frame's adaptive room against a fixed 2 KiB frame and flat gloo, in one job.

    plait-run -n 2 python bench/hier_frame.py --hosts 2     # 2 simulated hosts x 1 rank
    plait-run -n 4 python bench/hier_frame.py --hosts 2     # 2 simulated hosts x 2 ranks

Each rank sets PLAIT_HOST_ID to its host (ranks split in order). Two multi-host communicators over
the same ranks: plait.init's (adaptive room, the default) and a split of it made with
PLAIT_HIER_FRAME_ADAPT=0 (the room stays 1984 bytes, every frame 2 KiB: plait before the room
adapted); beside them a flat gloo process group. For each size (numpy float32 sum, in place) the
three take turns in batches so the machine's drift hits all alike; rank 0 prints the slowest rank's
median batch time per call and the ratios. Results: bench/RESULTS-hier.md.
"""

import argparse
import os
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2, help="simulated hosts (ranks split in order)")
    ap.add_argument("--sizes", default="8,1024,262144", help="bytes, comma separated")
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.25, help="seconds per timed batch")
    a = ap.parse_args(argv)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if n % a.hosts:
        raise SystemExit(f"{n} ranks do not split evenly over {a.hosts} hosts")
    os.environ["PLAIT_HOST_ID"] = f"bench-host{rank // (n // a.hosts)}"

    import torch
    import torch.distributed as dist

    import plait

    torch.set_num_threads(1)
    adaptive = plait.init(timeout=120)
    os.environ["PLAIT_HIER_FRAME_ADAPT"] = "0"
    fixed = adaptive.split(0)
    del os.environ["PLAIT_HIER_FRAME_ADAPT"]
    dist.init_process_group("gloo")
    rows = []
    for size in (int(s) for s in a.sizes.split(",")):
        x = np.ones(max(1, size // 4), dtype=np.float32)
        t = torch.from_numpy(x.copy())
        calls = {
            "adaptive": lambda x=x: adaptive.allreduce(x, out=x),
            "fixed 2 KiB": lambda x=x: fixed.allreduce(x, out=x),
            "gloo": lambda t=t: dist.all_reduce(t),
        }
        for fn in calls.values():  # warm up: past the room's shrinking run too
            for _ in range(40):
                fn()
        t0 = time.perf_counter()
        calls["gloo"]()
        iters = np.array([max(3, min(2000, int(a.budget / max(time.perf_counter() - t0, 1e-6))))])
        adaptive.broadcast(iters, 0)
        iters = int(iters[0])
        times = {k: [] for k in calls}
        for _ in range(a.batches):
            for k, fn in calls.items():
                adaptive.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[k].append((time.perf_counter() - t0) / iters * 1e6)
        med = np.array([sorted(v)[len(v) // 2] for v in times.values()])
        adaptive.allreduce(med, out=med, op="max")
        rows.append((size, iters, adaptive._c._frame_room, dict(zip(calls, med))))
    if rank == 0:
        load = os.getloadavg()[0]
        print(f"# {n} ranks on {a.hosts} simulated hosts, numpy float32 sum, load {load:.1f}")
        print(
            "| bytes | iters | room | adaptive (us) | fixed 2 KiB | gloo | adaptive/fixed | adaptive/gloo |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for size, iters, room, m in rows:
            ad, fx, gl = m["adaptive"], m["fixed 2 KiB"], m["gloo"]
            print(
                f"| {size} | {iters} | {room} | {ad:.0f} | {fx:.0f} | {gl:.0f} "
                f"| {ad / fx:.2f} | {ad / gl:.2f} |"
            )
    fixed.finalize()
    adaptive.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
