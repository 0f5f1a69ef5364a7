"""Data-parallel training of a small MLP on CPU over torch.distributed backend "plait".

    plait-run -n 2 examples/ddp_train.py
    torchrun --nproc-per-node 2 examples/ddp_train.py
    plait-run -n 2 examples/ddp_train.py --backend gloo      # the same run on gloo

Prints the loss per epoch and the time spent in communication: the wall time of DDP's gradient
all-reduces, from the moment a bucket is handed to the backend until its result is ready
(measured by a comm hook, so it includes time that overlaps the backward pass).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import plait.torch  # noqa: F401  (registers backend "plait")


def timed_allreduce(stats, bucket):
    """DDP's default hook (divide, then sum) with a stopwatch on the all-reduce."""
    start = time.perf_counter()
    grads = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(grads, async_op=True).get_future()

    def done(f):
        stats["comm_s"] += time.perf_counter() - start
        stats["calls"] += 1
        return f.value()[0]

    return fut.then(done)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="plait")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="steps per epoch")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun sets OMP_NUM_THREADS=1; without it every rank starts one intra-op thread per
        # core, and ranks x cores spinning threads make every step many times slower.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    dist.init_process_group(args.backend)  # env://: torchrun and plait-run both set it up
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 1),
    )
    ddp = DDP(model)
    stats = {"comm_s": 0.0, "calls": 0}
    ddp.register_comm_hook(stats, timed_allreduce)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of the data
    w_true = torch.linspace(-1, 1, 32)

    for epoch in range(1, args.epochs + 1):
        stats.update(comm_s=0.0, calls=0)
        total, t0 = torch.zeros(2), time.perf_counter()
        for _ in range(args.steps):
            x = torch.randn(args.batch, 32, generator=data)
            y = torch.tanh(x @ w_true).unsqueeze(1)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * args.batch, torch.tensor(float(args.batch))])
        elapsed = time.perf_counter() - t0
        dist.all_reduce(total)  # the loss over every rank's samples
        if rank == 0:
            print(
                f"epoch {epoch}: loss {total[0] / total[1]:.5f}  time {elapsed:.2f} s  "
                f"communication {stats['comm_s']:.3f} s in {stats['calls']} all-reduces "
                f"({1e6 * stats['comm_s'] / max(stats['calls'], 1):.0f} us each)  "
                f"[{args.backend}, {world} ranks]",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
