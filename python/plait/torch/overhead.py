"""Per-call cost of the torch layer: an 8-byte all-reduce three ways, on every rank in step.

    plait-run -n 2 -m plait.torch.overhead            # or: torchrun --nproc-per-node 2 -m ...

1. plait directly: comm.allreduce on a 2-element float32 numpy array (the floor);
2. dist.all_reduce on a process group of backend "plait" (sync, and async_op=True + wait());
3. dist.all_reduce on gloo.
Prints the best and the median of 7 timed batches (microseconds per call) on rank 0.
"""
import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from . import BACKEND


def _time(fn, iters):
    for _ in range(min(iters, 500)):
        fn()
    runs = []
    for _ in range(7):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    runs.sort()
    return runs[0], runs[3]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--gloo-iters", type=int, default=1000)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the gloo group also paces the batches of the other two
    rank = dist.get_rank()
    t = torch.ones(2)
    rows = [("dist.all_reduce, gloo", _time(lambda: dist.all_reduce(t), args.gloo_iters))]
    pg = dist.new_group(backend=BACKEND)
    rows.append(("dist.all_reduce, plait", _time(lambda: dist.all_reduce(t, group=pg), args.iters)))
    rows.append(("dist.all_reduce(async_op=True).wait(), plait",
                 _time(lambda: dist.all_reduce(t, group=pg, async_op=True).wait(), args.iters)))
    comm = pg._comm  # the group's own plait communicator
    x = np.ones(2, np.float32)
    rows.append(("plait comm.allreduce on numpy", _time(lambda: comm.allreduce(x, out=x), args.iters)))
    if rank == 0:
        print(f"8-byte all-reduce, {dist.get_world_size()} ranks, us per call (best, median):")
        for name, (best, median) in rows:
            print(f"  {name:46s} {best:8.1f} {median:8.1f}")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # a command, not library code: gloo sometimes aborts at interpreter exit


if __name__ == "__main__":
    main()
