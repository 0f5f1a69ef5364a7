"""horovod.torch.functions: broadcast of parameters, optimizer state and objects; allgather of
objects."""

import pickle

import numpy as np
import torch

from ..common.process_sets import global_process_set
from .mpi_ops import allgather, broadcast_, broadcast_async_, rank, synchronize


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Overwrites params (a state_dict, named_parameters() or a list of (name, tensor)) on every
    rank with the root's values."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        params = list(params)
        if params and not isinstance(params[0], tuple):
            params = [(None, p) for p in params]
    handles = []
    for i, (name, p) in enumerate(params):
        if p is None or not isinstance(p, torch.Tensor):
            continue
        handles.append(
            broadcast_async_(p, root_rank, name=f"bcast.param.{name if name else i}", process_set=process_set)
        )
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Makes every rank's optimizer state (and hyper-parameters) the root's. Ranks whose state is
    still empty (no step yet) get it created first, as Horovod does, so the tensors line up."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        # A step on zero gradients creates the state; the parameters are put back afterwards.
        saved = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    saved.append((p, p.data.clone(), p.grad))
                    p.grad = torch.zeros_like(p.data)
        step = getattr(optimizer, "_plait_raw_step", None)
        (step or optimizer.step)()
        for p, data, grad in saved:
            p.data.copy_(data)
            p.grad = grad
        state_dict = optimizer.state_dict()
    # Everything that is no tensor (hyper-parameters, step counts as numbers) travels pickled.
    scalars = {}
    tensors = []
    for gi, group in enumerate(state_dict["param_groups"]):
        for k, v in sorted(group.items()):
            if k != "params":
                scalars[f"group.{gi}.{k}"] = v
    for pid, pstate in sorted(state_dict["state"].items()):
        for k, v in sorted(pstate.items()):
            if isinstance(v, torch.Tensor):
                tensors.append((f"state.{pid}.{k}", v))
            else:
                scalars[f"state.{pid}.{k}"] = v
    scalars = broadcast_object(scalars, root_rank, name="optimizer.scalars", process_set=process_set)
    handles = [
        broadcast_async_(t, root_rank, name=f"bcast.opt.{n}", process_set=process_set) for n, t in tensors
    ]
    for h in handles:
        synchronize(h)
    for gi, group in enumerate(optimizer.param_groups):
        for k in list(group):
            if k != "params" and f"group.{gi}.{k}" in scalars:
                group[k] = scalars[f"group.{gi}.{k}"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for key, v in scalars.items():
        if key.startswith("state."):
            _, pid, k = key.split(".", 2)
            optimizer.state[params[int(pid)]][k] = v
    optimizer.load_state_dict(optimizer.state_dict())


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """The root's obj, pickled and broadcast (its length first), on every rank. The default name
    is the same on every rank (Horovod's, the object's type name, would differ where the other
    ranks pass None)."""
    name = name or "broadcast_object"
    if rank() == root_rank:
        data = torch.from_numpy(np.frombuffer(pickle.dumps(obj), dtype=np.uint8).copy())
        sz = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        sz = torch.zeros(1, dtype=torch.int64)
    broadcast_(sz, root_rank, name=f"{name}.sz", process_set=process_set)
    if rank() != root_rank:
        data = torch.zeros(int(sz.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, name=f"{name}.t", process_set=process_set)
    return pickle.loads(data.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """A list of every rank's obj (pickled and allgathered), in rank order."""
    name = name or "allgather_object"
    data = torch.from_numpy(np.frombuffer(pickle.dumps(obj), dtype=np.uint8).copy())
    sizes = allgather(
        torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sz", process_set=process_set
    )
    gathered = allgather(data, name=f"{name}.t", process_set=process_set).numpy().tobytes()
    out, at = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(gathered[at : at + n]))
        at += n
    return out
