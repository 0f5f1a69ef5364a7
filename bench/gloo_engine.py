"""The gloo engine's allreduce (csrc/torch/gloo_engine.cc) against the same ProcessGroupGloo called
from torch, in one run: what the engine adds to gloo on the multi-host path's inter-host step.

    plait-run -n 2 bench/gloo_engine.py

Two ProcessGroupGloo groups of identical options over one c10d store: one driven through the
engine (from_blob over a numpy array, the Future-woken wait, the flag looks), the other through
torch's Python binding (pg.allreduce([t]).wait()). Batches alternate between them so the machine's
drift hits both alike; rank 0 prints the slowest rank's median batch time per call and the ratio
to torch's. Two more rows per size show what the multi-host call check costs over the engine: its
frame exchange (an allgather of --frame bytes) before the payload, or started before the payload
and waited after it (both ops then run on gloo's worker threads at once). Float32 sum; 8 B,
256 KiB, 16 MiB by default. Results: bench/RESULTS-hier.md.
"""

import argparse
import os
import time
from datetime import timedelta


def _batch(fn, iters, barrier):
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,262144,16777216", help="bytes, comma separated")
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--frame", type=int, default=2048, help="bytes of the call check's frame (_C.HIER_FRAME)")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per timed batch (sets iterations)")
    a = ap.parse_args(argv)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

    from plait.torch import _native

    torch.set_num_threads(1)
    mod = _native.load()
    dist.init_process_group("gloo")  # its store serves both groups, its group the barriers
    store = dist.distributed_c10d._get_default_store()

    def group(name):
        opts = ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=120)
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return ProcessGroupGloo(PrefixStore(name, store), rank, n, opts)

    eng = mod.make_gloo_engine(group("bench-engine"), PrefixStore("bench-flag", store), "bench")
    pg = group("bench-torch")
    frame, frames = np.zeros(a.frame, np.uint8), np.zeros(a.frame * n, np.uint8)
    rows = []
    for size in (int(s) for s in a.sizes.split(",")):
        arr = np.ones(max(1, size // 4), np.float32)
        t = torch.from_numpy(arr.copy())
        opts = dist.AllreduceOptions()

        def checked(arr=arr):  # the multi-host call check's frame exchange, then the payload
            mod._engine_allgather(eng, frame, frames, 120.0)
            mod._engine_allreduce(eng, arr, 2, 0, 120.0)

        def overlapped(arr=arr):  # the frame exchange started first, waited after the payload
            req = mod._engine_allgather_start(eng, frame, frames)
            mod._engine_allreduce(eng, arr, 2, 0, 120.0)
            mod._engine_wait(eng, req, 120.0)

        calls = {
            "engine": lambda arr=arr: mod._engine_allreduce(eng, arr, 2, 0, 120.0),
            "torch": lambda t=t, opts=opts: pg.allreduce([t], opts).wait(),
            "frame+payload": checked,
            "frame||payload": overlapped,
        }
        for fn in calls.values():
            for _ in range(3):
                fn()
        t0 = time.perf_counter()
        calls["torch"]()
        one = time.perf_counter() - t0
        iters = torch.tensor([max(3, min(2000, int(a.budget / max(one, 1e-6))))])
        dist.broadcast(iters, 0)
        iters = int(iters)
        times = {k: [] for k in calls}
        for _ in range(a.batches):
            for k, fn in calls.items():
                times[k].append(_batch(fn, iters, dist.barrier))
        med = torch.tensor([sorted(v)[len(v) // 2] for v in times.values()], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        x = (np.arange(arr.size) % 97).astype(np.float32) * (rank + 1)
        mod._engine_allreduce(eng, x, 2, 0, 120.0)
        wrong = torch.tensor([int((x != (np.arange(arr.size) % 97) * (n * (n + 1) // 2)).sum())])
        dist.all_reduce(wrong)
        rows.append((size, iters, med.tolist(), int(wrong)))
    mod._engine_release(eng)
    if rank == 0:
        print(f"# {n} ranks, torch {torch.__version__}, float32 sum, gloo engine vs the same gloo from torch")
        print(
            "| bytes | iters | engine (us) | torch pg.allreduce().wait() (us) | ratio "
            f"| {a.frame} B frame, then payload | ratio "
            "| frame started, payload, frame waited | ratio | #wrong |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for size, iters, (e, p, fp, fo), wrong in rows:
            print(
                f"| {size} | {iters} | {e:.0f} | {p:.0f} | {e / p:.2f} | {fp:.0f} | {fp / p:.2f} "
                f"| {fo:.0f} | {fo / p:.2f} | {wrong} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
