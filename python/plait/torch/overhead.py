"""Per-call cost of the torch layer, and a training step, on every rank in step.

    plait-run -n 2 -m plait.torch.overhead            # or: torchrun --nproc-per-node 2 -m ...
    plait-run -n 4 -m plait.torch.overhead            # 4 ranks on a 2-core machine: oversubscribed

1. plait directly: comm.allreduce on a 2-element float32 numpy array (the floor);
2. dist.all_reduce on a process group of backend "plait" (the native c10d backend), sync and
   async_op=True + wait() (what DDP and FSDP do);
3. dist.all_reduce on gloo, and on torch's FakeProcessGroup, which does no work at all: the cost
   of torch's own layers (Python wrapper, dispatcher, Work), a floor no backend can go below;
4. one DDP step and one FSDP2 step of a wide MLP with a small batch (communication-bound), on
   gloo and on plait, and on plait with plait.torch.use_shared_buffers.
Prints the best and the median of 7 timed batches on rank 0, torch's floor (the fake group), and
ratios of medians: plait native against the direct call, against torch's floor and against gloo.
Each group's sync and async+wait batches alternate, and their ratio is also given as the median of
the per-pair ratios. Timings on a shared or oversubscribed machine move by 2x between runs.
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from . import BACKEND, _native, communicator, use_shared_buffers


def _batch(fn, iters):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def _best_median(runs):
    runs = sorted(runs)
    return runs[0], runs[len(runs) // 2]


def _time(fn, iters, batches=7):
    for _ in range(min(iters, 500)):
        fn()
    return _best_median([_batch(fn, iters) for _ in range(batches)])


def _paired(sync, asyn, iters, batches=7):
    """Times sync and async batches alternately; also the median of the per-pair ratios
    async/sync, which the machine's drift between batches moves less than a ratio of medians."""
    for _ in range(min(iters, 500)):
        sync()
        asyn()
    ts, ta = [], []
    for _ in range(batches):
        ts.append(_batch(sync, iters))
        ta.append(_batch(asyn, iters))
    ratios = sorted(a / s for s, a in zip(ts, ta))
    return _best_median(ts), _best_median(ta), ratios[len(ratios) // 2]


def _fake_group():
    """A group on torch's FakeProcessGroup (a testing aid that completes every call at once)."""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

        return dist.new_group(backend="fake")
    except Exception:  # not in every torch build
        return None


def _mlp(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _step_fn(model, width, batch):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return step


def _ddp_step(pg, width, depth, batch, shared=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(width, depth), process_group=pg)
    if shared:
        use_shared_buffers(model)
    return _step_fn(model, width, batch)


def _fsdp2_step(pg, width, depth, batch, gloo, shared=False):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(pg, "cpu")
    model = _mlp(width, depth)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if gloo:  # gloo has no AVG
        model.set_force_sum_reduction_for_comms(True)
    if shared:
        use_shared_buffers(model)
    return _step_fn(model, width, batch)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--gloo-iters", type=int, default=1000)
    p.add_argument("--steps", type=int, default=10, help="training steps per timed batch")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--no-train", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the gloo group also paces the batches of the others
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.ones(2)
    rows = [("dist.all_reduce, gloo", _time(lambda: dist.all_reduce(t), args.gloo_iters))]
    paired = {}  # impl: median of the paired async+wait / sync ratios

    def sync_and_async(impl, label, pg):
        s, a, paired[impl] = _paired(
            lambda: dist.all_reduce(t, group=pg),
            lambda: dist.all_reduce(t, group=pg, async_op=True).wait(),
            args.iters,
        )
        rows.append((f"dist.all_reduce, {label}", s))
        rows.append((f"dist.all_reduce(async_op=True).wait(), {impl}", a))

    floor = _fake_group()
    if floor is not None:
        sync_and_async("fake", "fake (torch's floor)", floor)
    _native.load()
    groups = {"native": dist.new_group(backend=BACKEND)}
    for impl, pg in groups.items():
        sync_and_async(f"plait {impl}", f"plait {impl}", pg)
    comm = communicator(next(iter(groups.values())))
    x = np.ones(2, np.float32)
    rows.append(("plait comm.allreduce on numpy", _time(lambda: comm.allreduce(x, out=x), args.iters)))
    train = []
    if not args.no_train:
        shape = (args.width, args.depth, args.batch)
        for name, pg in [("gloo", dist.group.WORLD)] + [(f"plait {k}", g) for k, g in groups.items()]:
            ddp = _ddp_step(pg, *shape)
            train.append((f"DDP step, {name}", _time(ddp, args.steps, 5)))
            fsdp = _fsdp2_step(pg, *shape, gloo=name == "gloo")
            train.append((f"FSDP2 step, {name}", _time(fsdp, args.steps, 5)))
        if "native" in groups:  # communication buffers in plait shared memory (use_shared_buffers)
            ddp = _ddp_step(groups["native"], *shape, shared=True)
            train.append(("DDP step, plait native shared", _time(ddp, args.steps, 5)))
            fsdp = _fsdp2_step(groups["native"], *shape, gloo=False, shared=True)
            train.append(("FSDP2 step, plait native shared", _time(fsdp, args.steps, 5)))
    if rank == 0:
        print(f"8-byte all-reduce, {n} ranks, us per call (best, median):")
        for name, (best, median) in rows:
            print(f"  {name:56s} {best:9.1f} {median:9.1f}")
        med = {name: m for name, (_, m) in rows + train}
        if "native" in groups:
            direct = med["plait comm.allreduce on numpy"]
            sync = med["dist.all_reduce, plait native"]
            asyn = med["dist.all_reduce(async_op=True).wait(), plait native"]
            print(
                f"  ratios (medians): sync/direct {sync / direct:.2f}, async+wait/direct "
                f"{asyn / direct:.2f}, async+wait/sync {asyn / sync:.2f}"
            )
            print(
                "  async+wait/sync, median of paired batches: "
                + ", ".join(f"{impl} {r:.2f}" for impl, r in paired.items())
            )
            if floor is not None:
                fs = med["dist.all_reduce, fake (torch's floor)"]
                fa = med["dist.all_reduce(async_op=True).wait(), fake"]
                print(
                    f"  torch's floor (fake group, no work; medians): sync {fs:.1f} us, "
                    f"async+wait {fa:.1f} us"
                )
                print(
                    f"  plait native above torch's floor (medians): sync {sync - fs:.1f} us = "
                    f"{(sync - fs) / direct:.2f}x direct, async+wait {asyn - fa:.1f} us = "
                    f"{(asyn - fa) / direct:.2f}x direct"
                )
        if train:
            w, d, b = args.width, args.depth, args.batch
            print(f"training step of a {d}-layer {w}-wide MLP, batch {b}, us per step (best, median):")
            for name, (best, median) in train:
                print(f"  {name:56s} {best:9.0f} {median:9.0f}")
            impls = list(groups) + (["native shared"] if "native" in groups else [])
            for kind in ("DDP", "FSDP2"):
                for impl in impls:
                    print(
                        f"  {kind} plait {impl} / gloo (medians): "
                        f"{med[f'{kind} step, plait {impl}'] / med[f'{kind} step, gloo']:.2f}"
                    )
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # a command, not library code: gloo sometimes aborts at interpreter exit


if __name__ == "__main__":
    main()
