"""horovod.torch.mpi_ops on plait: the collectives, their async forms, handles and autograd.

Every op is a request to the coordinator (common/_controller.py), matched across ranks by name:
'<kind>.<name>', or '<kind>.noname.<n>' for unnamed ones. Results and errors arrive through an
integer handle (poll / synchronize), as in Horovod; errors are HorovodInternalError.
"""

import itertools
import threading

import torch

from ..common import _device, _fusion
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
    "HorovodInternalError",
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
    if not t.is_cpu:
        try:
            _device.layer.index(t)
        except TypeError as e:
            raise TypeError(f"rank {rank()}: {what}: {e}") from None
    return d


def _ps(process_set):
    ps_id, _ = _basics.ps_members(process_set or global_process_set)
    return ps_id


def _req(kind, name, ps_id, t, op=0, root=-1, pre=1.0, post=1.0, splits=None, dtype=None):
    req = [
        kind,
        name,
        ps_id,
        dtype or _dtype(t, kind),
        list(t.shape),
        int(op),
        int(root),
        float(pre),
        float(post),
        splits,
    ]
    where = _device.layer.index(t)
    if where >= 0:  # a CUDA tensor: the op runs on plait's GPU path (common/_device.py)
        req.append(where)
    return req


_tls = threading.local()


def _register(ops, result):
    if getattr(_tls, "sync", False):
        # A synchronous call runs the cycle on this thread at once (_now): no need to wake the
        # coordinator's thread, nor for a handle.
        _tls.entry = (ops, result)
        return None
    # The coordinator's thread is not woken: its next cycle (within HOROVOD_CYCLE_TIME, as in
    # Horovod) or the thread that synchronizes takes every op queued by then, so a burst of async
    # ops (a backward pass's hooks) meets in one cycle and is fused, instead of a cycle each.
    # 10 x allreduce_async_ of 1 KiB then synchronize: 250-285 us a step, against 570-735 us when
    # each submission woke the thread (2 ranks, alternating jobs, load 3).
    _basics.submit(ops, notify=False)
    h = next(_handles)
    with _map_lock:
        _handle_map[h] = (ops, result)
    return h


def _now(fn, *args, **kwargs):
    """fn(...) waited for: the synchronous form of an async op."""
    _tls.sync = True
    try:
        fn(*args, **kwargs)
    finally:
        _tls.sync = False
    ops, result = _tls.entry
    _tls.entry = None
    _basics.run(ops)
    return result(ops)


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
        d = _dtype(t, "allreduce")
        n = name if name is None or len(tensors) == 1 else f"{name}_{i}"
        if inplace and t.is_contiguous():
            out, fin = t.detach(), None
        else:
            out = t.detach().clone(memory_format=torch.contiguous_format)
            fin = _copy_back(t) if inplace else None
        req = _req(kind, _basics.next_name("allreduce", n), ps_id, out, op, -1, pre, post, None, d)
        ops.append(Op(req, t, out, fin))
    return ops


def _group_ops(tensors, inplace, name, op, pre, post, process_set):
    """A group is one request per dtype (Horovod fuses a group's tensors together): the executor
    gathers its tensors into the fusion buffer with one torch.cat and scatters them back in one
    pass, so a group of many small tensors costs about one allreduce of their total size. The
    layout (common/_fusion.py) is kept across calls with the same tensors."""
    ps_id = _ps(process_set)
    lay = _fusion.lookup(tensors)
    if lay is None:
        by_dtype = {}  # (dtype, device): one request each
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or not t.is_cpu:  # refused with the rank and op
                _dtype(t, "grouped_allreduce")
            where = _device.layer.index(t)
            by_dtype.setdefault((t.dtype, where), []).append(i)
        for idx in by_dtype.values():
            _dtype(tensors[idx[0]], "grouped_allreduce")
        if all(t.is_contiguous() for t in tensors):
            lay = _fusion.remember(tensors, list(by_dtype.values()))
        else:
            return _group_ops_strided(tensors, inplace, name, op, pre, post, ps_id, by_dtype)
    ops, order = [], []
    for part in lay.parts:
        d = _DTYPES[part.dtype]
        n = name if name is None or len(lay.parts) == 1 else f"{name}.{d}{_where(part.device)}"
        req = ["allreduce", _basics.next_name("allreduce", n), ps_id, d, [part.total], int(op), -1]
        req += [float(pre), float(post), part.shapes]
        if part.device >= 0:
            req.append(part.device)
        sub = tensors if len(lay.parts) == 1 else [tensors[i] for i in part.idx]
        o = Op(req, sub, sub if inplace else None)
        o.layout = part
        ops.append(o)
        order.append(part.idx)
    return ops, order


def _group_ops_strided(tensors, inplace, name, op, pre, post, ps_id, by_dtype):
    """A group with a non-contiguous tensor: contiguous copies travel, and go back after."""
    ops, order = [], []
    for (_, where), idx in by_dtype.items():
        ts = [tensors[i] for i in idx]
        d = _DTYPES[ts[0].dtype]
        n = name if name is None or len(by_dtype) == 1 else f"{name}.{d}{_where(where)}"
        srcs = [t.detach() for t in ts]
        outs = fin = None
        if inplace:
            outs = [t.contiguous() for t in srcs]
            fin = _copy_back_all(ts)
        total = sum(t.numel() for t in ts)
        shapes = _fusion.shapes_text(t.shape for t in ts)
        req = ["allreduce", _basics.next_name("allreduce", n), ps_id, d, [total], int(op), -1, float(pre)]
        req += [float(post), shapes]
        if where >= 0:
            req.append(where)
        ops.append(Op(req, srcs, outs, fin))
        order.append(idx)
    return ops, order


def _where(device):
    """A group part's name suffix: none on the CPU (names stay Horovod's), '.cuda<i>' on a GPU."""
    return "" if device < 0 else f".cuda{device}"


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
    # allreduce_async_ and synchronize, without the handle (a training loop's hot call)
    op = _op_of(average, op)
    _basics.run(_allreduce_ops([tensor], True, name, op, prescale_factor, postscale_factor, process_set))
    return tensor


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
    op = _op_of(average, op)
    tensors = list(tensors)
    ops, _ = _group_ops(tensors, True, name, op, prescale_factor, postscale_factor, process_set)
    _basics.run(ops)
    return tensors


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


# The gathers, broadcast, alltoall, reducescatter, join and barrier live in _collectives.py.
from ._collectives import (  # noqa: E402, F401 - re-exported (the autograd classes too)
    HorovodAllgather,
    HorovodAlltoall,
    HorovodBroadcast,
    HorovodGroupedAllgather,
    HorovodGroupedReducescatter,
    HorovodReducescatter,
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    reducescatter,
    reducescatter_async,
)
