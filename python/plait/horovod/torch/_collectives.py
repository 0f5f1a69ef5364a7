"""horovod.torch's gathers, broadcast, alltoall, reducescatter, join and barrier (mpi_ops
re-exports them; split from it for length). Same request / handle machinery as the allreduces."""

import torch

from ..common import basics as _basics
from ..common._controller import Op
from ..common.process_sets import global_process_set
from .mpi_ops import Average, _copy_back, _now, _op_of, _ps, _register, _req, allreduce, rank


# -- allgather ---------------------------------------------------------------------------------
def _gather_op(t, name, ps_id):
    if t.dim() == 0:
        raise ValueError(f"rank {rank()}: allgather needs a tensor of at least one dimension")
    x = t.detach().contiguous()
    return Op(_req("allgather", _basics.next_name("allgather", name), ps_id, x), x)


def allgather_async(tensor, name=None, process_set=global_process_set):
    ops = [_gather_op(tensor, name, _ps(process_set))]
    return _register(ops, lambda o: o[0].result[0])


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    ps_id = _ps(process_set)
    tensors = list(tensors)
    ops = [_gather_op(t, None if name is None else f"{name}_{i}", ps_id) for i, t in enumerate(tensors)]
    return _register(ops, lambda o: [x.result[0] for x in o])


class HorovodAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim, ctx.ps = tensor.shape[0], process_set
        return _now(allgather_async, tensor, name, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_grad(grad_output, ctx.dim, ctx.ps), None, None


def _gather_grad(grad_output, dim, process_set):
    g = allreduce(grad_output, op=Average, process_set=process_set)
    dims = _now(allgather_async, torch.tensor([dim], dtype=torch.int64), process_set=process_set)
    ps_rank = process_set.rank() if process_set is not None and process_set.process_set_id else rank()
    offset = int(dims[:ps_rank].sum())
    return g.narrow(0, offset, dim)


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenation along the first dimension of every rank's tensor (first dimensions may differ)."""
    return HorovodAllgather.apply(tensor, name, process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims, ctx.ps = [t.shape[0] for t in tensors], process_set
        return tuple(_now(grouped_allgather_async, list(tensors), name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + tuple(_gather_grad(g, d, ctx.ps) for g, d in zip(grads, ctx.dims))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast ---------------------------------------------------------------------------------
def _broadcast_ops(tensor, root_rank, name, process_set, inplace):
    ps_id = _ps(process_set)
    if inplace and tensor.is_contiguous():
        out, fin = tensor.detach(), None
    else:
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        fin = _copy_back(tensor) if inplace else None
    return [
        Op(
            _req("broadcast", _basics.next_name("broadcast", name), ps_id, out, 0, root_rank),
            tensor,
            out,
            fin,
        )
    ]


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return _register(_broadcast_ops(tensor, root_rank, name, process_set, False), lambda o: o[0].output)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return _register(_broadcast_ops(tensor, root_rank, name, process_set, True), lambda o: tensor)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return _now(broadcast_async_, tensor, root_rank, name, process_set)


class HorovodBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.ps = root_rank, process_set
        return _now(broadcast_async, tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        g = allreduce(grad_output, op=Average, process_set=ctx.ps)
        if rank() != ctx.root:
            g = g * 0
        return g, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall ----------------------------------------------------------------------------------
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Block j (splits[j] rows; equal blocks without splits) goes to rank j of the set."""
    ps_id, members = _basics.ps_members(process_set)
    x = tensor.detach().contiguous()
    if x.dim() == 0:
        raise ValueError(f"rank {rank()}: alltoall needs a tensor of at least one dimension")
    if splits is None:
        if x.shape[0] % len(members):
            raise ValueError(
                f"rank {rank()}: alltoall without splits needs the first dimension ({x.shape[0]}) "
                f"to divide by the number of ranks ({len(members)})"
            )
        s = None
    else:
        s = [int(v) for v in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(s) != len(members) or any(v < 0 for v in s) or sum(s) != x.shape[0]:
            raise ValueError(
                f"rank {rank()}: alltoall splits {s} must be {len(members)} non-negative counts "
                f"summing to the first dimension {x.shape[0]}"
            )
    ops = [Op(_req("alltoall", _basics.next_name("alltoall", name), ps_id, x, splits=s), x)]
    return _register(ops, lambda o: o[0].result)


class HorovodAlltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, recv = _now(alltoall_async, tensor, splits, name, process_set)
        ctx.recv, ctx.ps = recv, process_set
        ctx.mark_non_differentiable(recv)
        return out, recv

    @staticmethod
    def backward(ctx, grad_output, grad_splits=None):
        g, _ = _now(alltoall_async, grad_output.contiguous(), ctx.recv, process_set=ctx.ps)
        return g, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Returns the received tensor; with splits also the received splits (int32, per rank)."""
    out, recv = HorovodAlltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, recv)


# -- reducescatter -----------------------------------------------------------------------------
def _rs_ops(tensors, name, op, pre, post, process_set):
    op = _op_of(None, op)
    ps_id = _ps(process_set)
    ops = []
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise ValueError(f"rank {rank()}: reducescatter needs a tensor of at least one dimension")
        x = t.detach().contiguous()
        n = name if name is None or len(tensors) == 1 else f"{name}_{i}"
        ops.append(
            Op(_req("reducescatter", _basics.next_name("reducescatter", n), ps_id, x, op, -1, pre, post), x)
        )
    return ops


def reducescatter_async(
    tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
):
    """Rank r of the set gets block r of the reduction (first dimension split as evenly as
    possible, the lower ranks taking the extra rows)."""
    ops = _rs_ops([tensor], name, op, prescale_factor, postscale_factor, process_set)
    return _register(ops, lambda o: o[0].result)


def grouped_reducescatter_async(
    tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
):
    ops = _rs_ops(list(tensors), name, op, prescale_factor, postscale_factor, process_set)
    return _register(ops, lambda o: [x.result for x in o])


def _rs_grad(g, op, pre, post, process_set):
    out = _now(allgather_async, g.contiguous(), process_set=process_set)
    _, members = _basics.ps_members(process_set)
    f = pre * post / (len(members) if op == Average else 1)
    return out * f if f != 1 else out


class HorovodReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, pre, post):
        ctx.op, ctx.ps, ctx.pre, ctx.post = op, process_set, pre, post
        return _now(reducescatter_async, tensor, name, op, process_set, pre, post)

    @staticmethod
    def backward(ctx, grad_output):
        return _rs_grad(grad_output, ctx.op, ctx.pre, ctx.post, ctx.ps), None, None, None, None, None


def reducescatter(
    tensor,
    name=None,
    compression=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    from .compression import Compression

    compression = compression or Compression.none
    c, cctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(c, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, cctx)


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, pre, post, *tensors):
        ctx.op, ctx.ps, ctx.pre, ctx.post = op, process_set, pre, post
        return tuple(_now(grouped_reducescatter_async, list(tensors), name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * 5 + tuple(_rs_grad(g, ctx.op, ctx.pre, ctx.post, ctx.ps) for g in grads)


def grouped_reducescatter(
    tensors,
    name=None,
    compression=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    from .compression import Compression

    compression = compression or Compression.none
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *[p[0] for p in pairs]
    )
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


# -- join, barrier -----------------------------------------------------------------------------
def join(device=-1):
    """This rank has no more data: until every rank has joined it takes part in the others' ops
    with zeros (the op's identity for min/max/product, no rows for gathers). Returns the rank
    that joined last."""
    op = Op(["join", "join", 0, "uint8", [], 0, -1, 1.0, 1.0, None], None)
    _basics.controller().join_device = int(device)  # GPU ops' zeros are made there (-1: current)
    _basics.submit([op])
    _basics.wait([op])
    return op.result


def barrier(process_set=global_process_set):
    """Returns once every rank of the set has called it."""
    ps_id = _ps(process_set)
    n = _basics._st().counters.get(("barrier", ps_id), 0) + 1
    _basics._st().counters[("barrier", ps_id)] = n
    op = Op(["barrier", f"barrier.{n}", ps_id, "uint8", [], 0, -1, 1.0, 1.0, None], None)
    _basics.submit([op])
    _basics.wait([op])
