"""horovod.torch.mpi_ops on plait: the collectives, their async forms, handles and autograd.

Every op is a request to the coordinator (common/_controller.py), matched across ranks by name:
'<kind>.<name>', or '<kind>.noname.<n>' for unnamed ones. Results and errors arrive through an
integer handle (poll / synchronize), as in Horovod; errors are HorovodInternalError.
"""

import itertools
import math
import threading

import torch

from ..common import basics as _basics
from ..common._controller import Op
from ..common.exceptions import HorovodInternalError
from ..common.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

init = _basics.init
shutdown = _basics.shutdown
is_initialized = _basics.is_initialized
start_timeline = _basics.start_timeline
stop_timeline = _basics.stop_timeline
size = _basics.size
local_size = _basics.local_size
cross_size = _basics.cross_size
rank = _basics.rank
local_rank = _basics.local_rank
cross_rank = _basics.cross_rank
mpi_threads_supported = _basics.mpi_threads_supported
mpi_enabled = _basics.mpi_enabled
mpi_built = _basics.mpi_built
gloo_enabled = _basics.gloo_enabled
gloo_built = _basics.gloo_built
nccl_built = _basics.nccl_built
ddl_built = _basics.ddl_built
ccl_built = _basics.ccl_built
cuda_built = _basics.cuda_built
rocm_built = _basics.rocm_built
is_homogeneous = _basics.is_homogeneous

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5

_DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}
_handle_map = {}
_handles = itertools.count(1)
_map_lock = threading.Lock()

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank", "local_rank",
    "cross_rank", "Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier",
    "poll", "synchronize", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
]  # fmt: skip


def _op_of(average, op):
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise NotImplementedError(
            "Adasum is not offered by plait.horovod (as in a Horovod build without MPI): "
            "use op=hvd.Average or hvd.Sum"
        )
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"unknown reduction op {op!r}")
    return op


def _dtype(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rank {rank()}: {what} needs a torch.Tensor, got {type(t).__name__}")
    d = _DTYPES.get(t.dtype)
    if d is None:
        raise TypeError(
            f"rank {rank()}: {what}: dtype {t.dtype} is not supported "
            f"(plait takes {', '.join(_DTYPES.values())})"
        )
    if t.device.type != "cpu":
        raise TypeError(
            f"rank {rank()}: {what}: plait.horovod runs its ops on CPU tensors, got one on {t.device}"
        )
    return d


def _ps(process_set):
    ps_id, _ = _basics.ps_members(process_set or global_process_set)
    return ps_id


def _req(kind, name, ps_id, t, op=0, root=-1, pre=1.0, post=1.0, splits=None):
    return [
        kind,
        name,
        ps_id,
        _dtype(t, kind),
        list(t.shape),
        int(op),
        int(root),
        float(pre),
        float(post),
        splits,
    ]


_tls = threading.local()


def _register(ops, result):
    # A synchronous call waits (and runs the cycle) on this thread at once: no need to wake the
    # coordinator's thread for it.
    _basics.submit(ops, notify=not getattr(_tls, "sync", False))
    h = next(_handles)
    with _map_lock:
        _handle_map[h] = (ops, result)
    return h


def _now(fn, *args, **kwargs):
    """fn(...)'s handle, synchronized: the synchronous form of an async op."""
    _tls.sync = True
    try:
        h = fn(*args, **kwargs)
    finally:
        _tls.sync = False
    return synchronize(h)


def poll(handle):
    """True when the op behind handle has finished (synchronize then returns at once)."""
    with _map_lock:
        entry = _handle_map.get(handle)
    if entry is None:
        raise ValueError(f"handle {handle} is unknown (already synchronized?)")
    return all(o.done for o in entry[0])


def synchronize(handle):
    """Waits for the op behind handle and returns its output; raises HorovodInternalError."""
    with _map_lock:
        entry = _handle_map.pop(handle, None)
    if entry is None:
        return None
    ops, result = entry
    _basics.wait(ops)
    return result(ops)


# -- allreduce ---------------------------------------------------------------------------------
def _allreduce_ops(tensors, inplace, name, op, pre, post, process_set, kind="allreduce"):
    ps_id = _ps(process_set)
    ops = []
    for i, t in enumerate(tensors):
        _dtype(t, "allreduce")
        n = name if name is None or len(tensors) == 1 else f"{name}_{i}"
        if inplace and t.is_contiguous():
            out, fin = t.detach(), None
        else:
            out = t.detach().clone(memory_format=torch.contiguous_format)
            fin = _copy_back(t) if inplace else None
        ops.append(
            Op(_req(kind, _basics.next_name("allreduce", n), ps_id, out, op, -1, pre, post), t, out, fin)
        )
    return ops


def _group_ops(tensors, inplace, name, op, pre, post, process_set):
    """A group is one request per dtype (Horovod fuses a group's tensors together): the executor
    copies its tensors into the fusion buffer with one torch.cat and out with one foreach copy,
    so a group of many small tensors costs about one allreduce of their total size."""
    ps_id = _ps(process_set)
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    ops, order = [], []
    for idx in by_dtype.values():
        ts = [tensors[i] for i in idx]
        d = _dtype(ts[0], "grouped_allreduce")
        if not all(t.is_cpu for t in ts):
            _dtype(next(t for t in ts if not t.is_cpu), "grouped_allreduce")
        n = name if name is None or len(by_dtype) == 1 else f"{name}.{d}"
        srcs = [t.detach() for t in ts]
        outs = fin = None
        if inplace:
            outs = srcs
            if not all(t.is_contiguous() for t in ts):
                outs = [t.contiguous() for t in srcs]
                fin = _copy_back_all(ts)
        total = sum(t.numel() for t in ts)
        shapes = [t.shape for t in ts]  # torch.Size is a tuple: it travels as a JSON list
        req = ["allreduce", _basics.next_name("allreduce", n), ps_id, d, [total], int(op), -1, float(pre)]
        req += [float(post), shapes]
        ops.append(Op(req, srcs, outs, fin))
        order.append(idx)
    return ops, order


def _ungroup(ops, order):
    out = [None] * sum(len(i) for i in order)
    for o, idx in zip(ops, order):
        for i, t in zip(idx, o.result):
            out[i] = t
    return out


def _copy_back_all(ts):
    def fin(op, result):
        for t, o in zip(ts, op.output):
            if o is not t:
                t.data.copy_(o)
        return result

    return fin


def _copy_back(t):
    def fin(op, result):
        t.data.copy_(op.output)
        return result

    return fin


def allreduce_async(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    op = _op_of(average, op)
    ops = _allreduce_ops([tensor], False, name, op, prescale_factor, postscale_factor, process_set)
    return _register(ops, lambda o: o[0].output)


def allreduce_async_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    op = _op_of(average, op)
    ops = _allreduce_ops([tensor], True, name, op, prescale_factor, postscale_factor, process_set)
    return _register(ops, lambda o: tensor)


def allreduce_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    return _now(allreduce_async_, tensor, average, name, op, prescale_factor, postscale_factor, process_set)


class HorovodAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.average, ctx.op, ctx.pre, ctx.post, ctx.ps = (
            average,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )
        return _now(
            allreduce_async, tensor, average, name, op, prescale_factor, postscale_factor, process_set
        )

    @staticmethod
    def backward(ctx, grad_output):
        g = allreduce(
            grad_output,
            average=ctx.average,
            op=ctx.op,
            prescale_factor=ctx.pre,
            postscale_factor=ctx.post,
            process_set=ctx.ps,
        )
        return g, None, None, None, None, None, None


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """The reduction over all ranks of the set; the input is left alone. compression: e.g.
    Compression.fp16 (the tensor travels compressed, the result is decompressed)."""
    from .compression import Compression

    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(
        compressed, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return compression.decompress(out, ctx)


def grouped_allreduce_async(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    op = _op_of(average, op)
    ops, order = _group_ops(list(tensors), False, name, op, prescale_factor, postscale_factor, process_set)
    return _register(ops, lambda o: _ungroup(o, order))


def grouped_allreduce_async_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    op = _op_of(average, op)
    tensors = list(tensors)
    ops, _ = _group_ops(tensors, True, name, op, prescale_factor, postscale_factor, process_set)
    return _register(ops, lambda o: tensors)


def grouped_allreduce_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    return _now(
        grouped_allreduce_async_, tensors, average, name, op, prescale_factor, postscale_factor, process_set
    )


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.average, ctx.op, ctx.pre, ctx.post, ctx.ps = (
            average,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )
        return tuple(
            _now(
                grouped_allreduce_async,
                list(tensors),
                average,
                name,
                op,
                prescale_factor,
                postscale_factor,
                process_set,
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        g = grouped_allreduce(
            list(grads),
            average=ctx.average,
            op=ctx.op,
            prescale_factor=ctx.pre,
            postscale_factor=ctx.post,
            process_set=ctx.ps,
        )
        return (None,) * 6 + tuple(g)


def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    from .compression import Compression

    compression = compression or Compression.none
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(
        average, name, op, prescale_factor, postscale_factor, process_set, *[p[0] for p in pairs]
    )
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """A sparse COO tensor's allreduce, as Horovod does it: allgather of its indices and values;
    Average divides the values by the set's size. Returns a handle."""
    op = _op_of(None, op)
    if op not in (Average, Sum):
        raise ValueError("sparse allreduce supports op=Average and op=Sum only")
    t = tensor.coalesce()
    ps_id, members = _basics.ps_members(process_set)
    idx = t._indices().t().contiguous()
    val = t._values().contiguous()
    base = name or None
    ops = [
        Op(
            _req(
                "allgather", _basics.next_name("allgather", f"{base}.indices" if base else None), ps_id, idx
            ),
            idx,
        ),
        Op(
            _req("allgather", _basics.next_name("allgather", f"{base}.values" if base else None), ps_id, val),
            val,
        ),
    ]

    def result(o):
        values = o[1].result[0]
        if op == Average:
            values = values / len(members)
        return torch.sparse_coo_tensor(o[0].result[0].t(), values, t.shape)

    return _register(ops, result)


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


def _numel(shape):
    return math.prod(shape)


HorovodInternalError = HorovodInternalError
