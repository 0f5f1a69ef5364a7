"""Fully sharded data parallel training (torch FSDP2, `fully_shard`) on CPU over backend "plait":
each rank keeps 1/N of every parameter; plait all-gathers them for each layer's forward and
backward pass and reduce-scatters the gradients.

    plait-run -n 2 examples/fsdp2_train.py
    torchrun --nproc-per-node 2 examples/fsdp2_train.py
    plait-run -n 2 examples/fsdp2_train.py --backend gloo     # the same run on gloo

No `import plait.torch` is needed: plait registers the backend with torch when torch imports.
Prints the loss per epoch and, at the end, each rank's share of the parameters.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="plait")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)  # env://, as torchrun and plait-run set it up
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, 1),
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.backend == "gloo":
        model.set_force_sum_reduction_for_comms(True)  # gloo has no AVG
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    w_true = torch.linspace(-1, 1, 16)
    for epoch in range(1, args.epochs + 1):
        total = torch.zeros(1)
        for _ in range(args.steps):
            x = torch.randn(32, 16, generator=data)
            loss = torch.nn.functional.mse_loss(model(x), torch.sin(x @ w_true).unsqueeze(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.detach()
        dist.all_reduce(total)
        if rank == 0:
            print(
                f"epoch {epoch}: loss {total.item() / (args.steps * world):.5f} "
                f"[{args.backend}, {world} ranks]",
                flush=True,
            )
    mine = sum(p.to_local().numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    counts = [None] * world
    dist.all_gather_object(counts, mine)
    if rank == 0:
        print(f"parameters: {full} in all, held per rank: {counts}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
