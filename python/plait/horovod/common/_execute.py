"""Runs the ops a cycle made ready, on plait collectives (Horovod's op manager).

Input: the ready list, equal on every rank: ((process set, name), {rank: request}). Everything
that decides which plait calls run (checks, fusion groups, padding) reads only those requests,
never this rank's own state, so every rank makes the same calls; a rank that has joined takes
part with zeros (or the op's identity) of the negotiated shape.

Requests: [kind, name, ps, dtype, shape, op, root, prescale, postscale, splits(, device)]; the
device (a CUDA index, -1 for the CPU; absent: the CPU) is this rank's own: ranks compare only
whether it is a GPU, and an op on CUDA tensors runs on plait's GPU path (common/_device.py).
"""

import math
import os

import numpy as np

from . import _device

KIND, NAME, PS, DTYPE, SHAPE, OP, ROOT, PRE, POST, SPLITS, DEVICE = range(11)
AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4, 5  # Horovod's ReduceOp values
OP_NAMES = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}
_PLAIT_OP = {1: "sum", 0: "sum", 3: "min", 4: "max", 5: "prod"}
_OPCODE = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}  # bindings/capi.h's plait_op
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_FUSION_DEFAULT = 128 << 20


_TORCH = []  # the torch module, once imported (torch is imported late: plait.horovod.common has no torch)


def _torch():
    if not _TORCH:
        import torch

        _TORCH.append(torch)
    return _TORCH[0]


def torch_dtype(name):
    return getattr(_torch(), name)


def fusion_threshold():
    v = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    return _FUSION_DEFAULT if not v else int(v)


def on_gpu(q):
    return len(q) > DEVICE and q[DEVICE] >= 0


def _where(q):
    return f"GPU {q[DEVICE]}" if on_gpu(q) else "CPU"


def _fmt_shape(s):
    return "[" + ", ".join(map(str, s)) + "]"


def check(key, reqs, members, joined):
    """None, or why the ranks' requests for one name disagree (the same text on every rank)."""
    items = sorted(reqs.items())
    r0, q0 = items[0]
    name = q0[NAME]

    def differ(field, label, show=str):
        for r, q in items[1:]:
            if q[field] != q0[field]:
                return (
                    f"Mismatched {q0[KIND]} {label} for tensor {name!r} (process set {key[0]}): "
                    f"rank {r0} sent {show(q0[field])}, rank {r} sent {show(q[field])}"
                )
        return None

    why = differ(KIND, "operations") or differ(DTYPE, "data types")
    if why:
        return why
    for r, q in items[1:]:
        if on_gpu(q) != on_gpu(q0):
            return (
                f"Mismatched {q0[KIND]} CPU/GPU device selection for tensor {name!r} (process set "
                f"{key[0]}): rank {r0} sent a tensor on the {_where(q0)}, rank {r} one on the {_where(q)}"
            )
    kind = q0[KIND]
    if kind in ("allreduce", "reducescatter"):
        why = differ(OP, "reduction ops", lambda v: OP_NAMES.get(v, v)) or differ(SHAPE, "shapes", _fmt_shape)
        why = why or differ(PRE, "prescale factors") or differ(POST, "postscale factors")
        why = why or differ(SPLITS, "group tensor shapes")
    elif kind == "broadcast":
        why = differ(ROOT, "root ranks") or differ(SHAPE, "shapes", _fmt_shape)
        if not why and q0[ROOT] in joined:
            why = f"broadcast of tensor {name!r}: root rank {q0[ROOT]} has already joined"
        if not why and q0[ROOT] not in members:
            why = f"broadcast of tensor {name!r}: root rank {q0[ROOT]} is not in process set {key[0]}"
    elif kind in ("allgather", "alltoall"):
        for r, q in items[1:]:
            if len(q[SHAPE]) != len(q0[SHAPE]) or q[SHAPE][1:] != q0[SHAPE][1:]:
                return (
                    f"Mismatched {kind} tensor shapes for tensor {name!r} (process set {key[0]}): "
                    f"rank {r0} sent {_fmt_shape(q0[SHAPE])}, rank {r} sent {_fmt_shape(q[SHAPE])} "
                    "(all dimensions but the first must agree)"
                )
    elif kind in ("add_ps", "rm_ps"):
        why = differ(SHAPE, "process set ranks")
    return why


class Executor:
    def __init__(self):
        self._fusion = None  # uint8 torch tensor over plait shared memory
        self._views = {}  # (dtype, first element, count) -> that span of the fusion buffer
        self.threshold = fusion_threshold()
        self.calls = 0  # plait collectives run (a fused group counts once): tests read it
        self.dev = None  # the torch.device of the op being run (None: the CPU)
        self.index = _device.CPU  # its CUDA device index

    def _buffer(self, nbytes):
        from plait import _shared

        if self._fusion is None or self._fusion.numel() < nbytes:
            self._fusion = _torch().from_numpy(_shared.empty(max(nbytes, 1 << 16), "uint8"))
            self._views = {}
        return self._fusion[:nbytes]

    def _span(self, dtype, at, count):
        """Elements at..at+count of the fusion buffer as dtype. A training loop asks for the same
        spans every step, and a dtype view of the buffer costs more than a dict lookup (about 25
        us per call measured here in torch 2.13), so they are kept until the buffer grows."""
        key = (dtype, at, count)
        v = self._views.get(key)
        if v is None:
            v = self._buffer((at + count) * dtype.itemsize).view(dtype)[at : at + count]
            if len(self._views) >= 256:
                self._views = {}
            self._views[key] = v
        return v

    def run(self, ctrl, ready):
        threshold = self.threshold
        joined = set(ctrl._joined)
        todo = []
        for key, reqs in ready:
            members = ctrl.members(key[0])
            vals = iter(reqs.values())
            q0 = next(vals)
            # The same cached request object from every rank: an allreduce that passed this check
            # before passes it again (a broadcast's root may have joined since: checked each time).
            if q0[KIND] != "allreduce" or any(v is not q0 for v in vals):
                why = check(key, reqs, members, joined)
                if why:
                    ctrl.complete(key, error=f"rank {ctrl.rank}: {why}")
                    continue
            ctrl.remember(key, reqs)
            todo.append((key, reqs))
        i = 0
        while i < len(todo):
            key, reqs = todo[i]
            q = next(iter(reqs.values()))
            kind = q[KIND]
            members = ctrl.members(key[0])
            if ctrl.rank not in members:
                i += 1
                continue
            group = [todo[i]]
            if kind == "allreduce":
                nbytes = _nbytes(q)
                fkey = (key[0], q[DTYPE], q[OP], q[PRE], q[POST], on_gpu(q))
                j = i + 1
                taken = []
                while j < len(todo) and nbytes < threshold:
                    k2, r2 = todo[j]
                    q2 = next(iter(r2.values()))
                    if (
                        q2[KIND] == "allreduce"
                        and (k2[0], q2[DTYPE], q2[OP], q2[PRE], q2[POST], on_gpu(q2)) == fkey
                    ):
                        if nbytes + _nbytes(q2) <= threshold:
                            group.append(todo[j])
                            nbytes += _nbytes(q2)
                            taken.append(j)
                    j += 1
                for j in reversed(taken):
                    del todo[j]
            if not on_gpu(q):
                self.dev = None
                self._one(ctrl, kind, group, nbytes if kind == "allreduce" else 0, key, reqs, q, members)
            else:
                ops = [ctrl._mine.get(k) for k, _ in group]
                index = next((o.device for o in ops if o is not None), None)
                if index is None:  # joined: zeros on the device join() named, else the current one
                    index = ctrl.join_device if ctrl.join_device >= 0 else _device.layer.current()
                self.dev, self.index = _device.layer.device(index), index
                with _device.on_device(index, ops):
                    self._one(ctrl, kind, group, nbytes if kind == "allreduce" else 0, key, reqs, q, members)
            i += 1

    def _one(self, ctrl, kind, group, nbytes, key, reqs, q, members):
        if kind == "allreduce":
            self._allreduce(ctrl, group, nbytes)
        else:
            getattr(self, "_" + kind)(ctrl, key, reqs, q, members)

    # -- the collectives -----------------------------------------------------------------------
    def _comm(self, ctrl, ps):
        self.calls += 1
        return ctrl.process_sets[ps].comm

    def _allreduce(self, ctrl, group, nbytes):
        torch = _torch()
        key0, reqs0 = group[0]
        q = next(iter(reqs0.values()))
        dtype = torch_dtype(q[DTYPE])
        members = ctrl.members(key0[0])
        op, pre = q[OP], q[PRE]
        pop, post = reduction(q, len(members))
        comm = self._comm(ctrl, key0[0])
        tl = ctrl.timeline
        ops = [ctrl._mine.get(k) for k, _ in group]
        if tl is not None:
            for k, _ in group:
                tl.op_start(k[1], "ALLREDUCE")
        if len(group) == 1 and ops[0] is not None and ops[0].req[SPLITS] is None:
            # One tensor: reduced in place where it lives (plait's staged_parts / single copy
            # algorithms read private memory directly: 336-342 us at 4 MiB, 2 ranks, against
            # 397-428 us through the shared fusion buffer, bench/RESULTS-horovod.md). A rank that
            # has joined takes the fused path below with zeros, making the same plait call.
            buf = ops[0].output
            _scale(buf, pre)
            comm.allreduce(buf, buf, op=pop)
            _scale(buf, post)
            ctrl.complete(group[0][0])
            if self.dev is None and not ctrl.planned(key0, None):
                self._keep(ctrl, key0, None, comm, pop, pre, post, None)
            return
        count = nbytes // dtype.itemsize
        base, shm = None, False
        if not nbytes:
            fused = torch.empty(0, dtype=dtype, device=self.dev)
        elif self.dev is None:  # plait shared memory
            fused, shm = self._span(dtype, 0, count), True
            base = self._fusion
        else:
            fused = _device.layer.buffer(self.index, nbytes).view(dtype)[:count]
            base = fused._base if fused._base is not None else fused
        # Every tensor in a native layout (a CPU group, plait's torch module built): the scale
        # factors ride on the native copies in and out instead of passes of their own.
        fold = self.dev is None and all(
            o is not None and o.layout is not None and o.layout.nat and o.output is not None for o in ops
        )
        offsets, at = [], 0
        if tl is not None:
            for k, _ in group:
                tl.activity(k[1], "MEMCPY_IN_FUSION_BUFFER")
        for (_, reqs), o in zip(group, ops):
            n = math.prod(next(iter(reqs.values()))[SHAPE])
            piece = self._span(dtype, at, n) if shm else fused[at : at + n]
            if o is None:
                piece.fill_(_identity(torch, dtype, op))
            elif o.layout is not None:  # a group of contiguous tensors: one gather
                o.layout.gather(piece, pre if fold else 1.0)
            elif o.req[SPLITS] is not None:  # a group with strided tensors
                if n:
                    piece.copy_(_flatten(o.tensor))
            else:
                piece.copy_(o.output.reshape(-1))
            offsets.append((at, n))
            at += n
        if not fold:
            _scale(fused, pre)
        if tl is not None:
            for k, _ in group:
                tl.activity(k[1], "PLAIT_ALLREDUCE")
        comm.allreduce(fused, fused, op=pop)
        if not fold:
            _scale(fused, post)
        if tl is not None:
            for k, _ in group:
                tl.activity(k[1], "MEMCPY_OUT_FUSION_BUFFER")
        for (k, _), o, (a, n) in zip(group, ops, offsets):
            if o is None:
                continue
            if o.req[SPLITS] is None:
                o.output.reshape(-1).copy_(fused[a : a + n])
                ctrl.complete(k)
                continue
            if o.output is None:  # out of place: views of one fresh tensor
                ctrl.complete(k, result=list(_unflatten(fused[a : a + n].clone(), o.tensor)))
            elif o.layout is not None:
                piece = self._span(dtype, a, n) if shm else fused[a : a + n]
                o.layout.scatter(base, a, piece, post if fold else 1.0)
                ctrl.complete(k, result=o.output)
            else:
                _copy_all(o.output, list(_unflatten(fused[a : a + n], o.output)))
                ctrl.complete(k, result=o.output)
        if len(group) == 1 and fold and shm and ops[0].output is not None:
            self._keep(ctrl, key0, ops[0].layout, comm, pop, pre, post, self._span(dtype, 0, count))

    def _keep(self, ctrl, key, layout, comm, pop, pre, post, span):
        """Hands the controller the plan of an allreduce that ran alone: the same steps, run by
        one native call in a later cycle of the same cached request (common/_fastpath.py)."""
        from plait import _C

        from . import _fusion

        if ctrl.planned(key, layout):
            return
        nat = _fusion.loaded()
        native = getattr(comm, "_c", None)
        if nat is None or not isinstance(native, _C._Comm) or not ctrl.fast_path(nat):
            return
        grp = layout.grp if layout is not None else None
        ctrl.keep_plan(
            key,
            layout,
            lambda: nat._HvdPlan(_C._comm_capsule(native), comm, _OPCODE[pop], pre, post, grp, span),
        )

    def _allgather(self, ctrl, key, reqs, q, members):
        torch = _torch()
        dtype = torch_dtype(q[DTYPE])
        rest = tuple(q[SHAPE][1:])
        rows = [reqs[r][SHAPE][0] if r in reqs else 0 for r in members]
        row = math.prod(rest)
        o = ctrl._mine.get(key)
        mine = o.tensor.reshape(-1) if o is not None else torch.empty(0, dtype=dtype, device=self.dev)
        comm = self._comm(ctrl, key[0])
        if ctrl.timeline is not None:
            ctrl.timeline.op_start(key[1], "ALLGATHER")
        m = max(rows)
        if m * row == 0:
            out = torch.empty((sum(rows),) + rest, dtype=dtype, device=self.dev)
        elif len(set(rows)) == 1:
            out = torch.empty((sum(rows),) + rest, dtype=dtype, device=self.dev)
            comm.allgather(mine, out)
        else:
            send = torch.zeros(m * row, dtype=dtype, device=self.dev)
            send[: mine.numel()].copy_(mine)
            got = torch.empty((len(members), m * row), dtype=dtype, device=self.dev)
            comm.allgather(send, got)
            out = torch.cat([got[i, : rows[i] * row] for i in range(len(members))]).view((sum(rows),) + rest)
        ctrl.complete(key, result=(out, rows))

    def _broadcast(self, ctrl, key, reqs, q, members):
        torch = _torch()
        o = ctrl._mine.get(key)
        buf = (
            o.output if o is not None else torch.zeros(q[SHAPE], dtype=torch_dtype(q[DTYPE]), device=self.dev)
        )
        if ctrl.timeline is not None:
            ctrl.timeline.op_start(key[1], "BROADCAST")
        if buf.numel():
            self._comm(ctrl, key[0]).broadcast(buf, members.index(q[ROOT]))
        ctrl.complete(key)

    def _alltoall(self, ctrl, key, reqs, q, members):
        torch = _torch()
        dtype = torch_dtype(q[DTYPE])
        n = len(members)
        rest = tuple(q[SHAPE][1:])
        row = math.prod(rest)
        splits = []
        for r in members:
            if r not in reqs:
                splits.append([0] * n)
            else:
                s = reqs[r][SPLITS]
                splits.append(s if s is not None else [reqs[r][SHAPE][0] // n] * n)
        bad = [r for r, s in zip(members, splits) if len(s) != n]
        if bad:
            ctrl.complete(key, error=f"alltoall of {key[1]!r}: rank(s) {bad} gave splits of the wrong length")
            return
        me = members.index(ctrl.rank)
        m = max(max(s) for s in splits)
        o = ctrl._mine.get(key)
        if ctrl.timeline is not None:
            ctrl.timeline.op_start(key[1], "ALLTOALL")
        recv = [splits[j][me] for j in range(n)]
        if m * row == 0:
            out = torch.empty((sum(recv),) + rest, dtype=dtype, device=self.dev)
        else:
            send = torch.zeros((n, m * row), dtype=dtype, device=self.dev)
            if o is not None:
                flat, at = o.tensor.reshape(-1), 0
                for j, c in enumerate(splits[me]):
                    send[j, : c * row].copy_(flat[at : at + c * row])
                    at += c * row
            got = torch.empty((n, m * row), dtype=dtype, device=self.dev)
            self._comm(ctrl, key[0]).alltoall(send, got)
            out = torch.cat([got[j, : recv[j] * row] for j in range(n)]).view((sum(recv),) + rest)
        ctrl.complete(key, result=(out, torch.tensor(recv, dtype=torch.int32)))

    def _reducescatter(self, ctrl, key, reqs, q, members):
        torch = _torch()
        dtype = torch_dtype(q[DTYPE])
        n = len(members)
        shape = tuple(q[SHAPE])
        rest, rows = shape[1:], shape[0]
        row = math.prod(rest)
        counts = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
        m = max(counts)
        op, pre, post = q[OP], q[PRE], q[POST]
        if op == AVERAGE:
            post = post / n
        o = ctrl._mine.get(key)
        if ctrl.timeline is not None:
            ctrl.timeline.op_start(key[1], "REDUCESCATTER")
        send = torch.full((n, m * row), _identity(torch, dtype, op), dtype=dtype, device=self.dev)
        if o is not None:
            flat, at = o.tensor.reshape(-1), 0
            for j, c in enumerate(counts):
                send[j, : c * row].copy_(flat[at : at + c * row])
                at += c * row
        me = members.index(ctrl.rank)
        got = torch.empty(m * row, dtype=dtype, device=self.dev)
        if m * row:
            _scale(send, pre)
            self._comm(ctrl, key[0]).reduce_scatter(send, got, op=_PLAIT_OP[op])
            _scale(got, post)
        out = got[: counts[me] * row].clone().view((counts[me],) + rest)
        ctrl.complete(key, result=out)

    def _barrier(self, ctrl, key, reqs, q, members):
        ctrl.complete(key)  # everyone reached it: that is what the negotiation established

    def _add_ps(self, ctrl, key, reqs, q, members):
        ranks = list(q[SHAPE])
        ps_id = q[ROOT]
        world = ctrl.process_sets[0].comm
        sub = world.split(
            0 if ctrl.rank in ranks else None, ranks.index(ctrl.rank) if ctrl.rank in ranks else 0
        )
        ctrl.process_sets.register(ps_id, ranks, sub)
        ctrl._plans.clear()  # they hold the communicators they were made with
        ctrl.complete(key, result=ps_id)

    def _rm_ps(self, ctrl, key, reqs, q, members):
        ctrl.process_sets.unregister(q[ROOT])
        ctrl._plans.clear()
        ctrl.complete(key)


def reduction(q, n):
    """(plait op, postscale factor) of an allreduce request over n ranks: a pure function of the
    request, so every rank, joined or not, makes the same plait call. A floating Average is
    plait's avg (the sum divided by n in the reduction's last step: no pass of its own; a joined
    rank's zeros count among the n, as in Horovod); an integer one is a sum and a postscale of
    1/n, truncated on the copy out as Horovod's ScaleBuffer does."""
    op, post = q[OP], q[POST]
    if op != AVERAGE:
        return _PLAIT_OP[op], post
    if q[DTYPE] in _FLOATS:
        return "avg", post
    return "sum", post / n


def _flatten(tensors):
    """One 1-D tensor of the tensors' elements, in order (C++: no Python loop over them)."""
    torch = _torch()
    if hasattr(torch._C._nn, "flatten_dense_tensors"):
        return torch._C._nn.flatten_dense_tensors(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat, like):
    """Views of flat shaped as the tensors in `like`."""
    torch = _torch()
    if hasattr(torch._C._nn, "unflatten_dense_tensors"):
        return torch._C._nn.unflatten_dense_tensors(flat, like)
    return [p.view_as(t) for p, t in zip(flat.split([t.numel() for t in like]), like)]


def _copy_all(dsts, srcs):
    torch = _torch()
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dsts, srcs)
    else:
        for d, s in zip(dsts, srcs):
            d.copy_(s)


def _nbytes(q):
    return math.prod(q[SHAPE]) * _ITEMSIZE.get(q[DTYPE], 4)


_ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}


def _identity(torch, dtype, op):
    if op == MIN:
        return (
            True
            if dtype == torch.bool
            else (torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max)
        )
    if op == MAX:
        return (
            False
            if dtype == torch.bool
            else (torch.finfo(dtype).min if dtype.is_floating_point else torch.iinfo(dtype).min)
        )
    if op == PRODUCT:
        return 1
    return 0


_NUMPY_SCALE = set()  # torch.float32 and torch.float64, filled on first use (torch imports late)


def _scale(t, f):
    """Horovod's ScaleBuffer: integers are multiplied in double precision and truncated."""
    if f == 1.0 or t.numel() == 0:
        return
    if not _NUMPY_SCALE:
        _NUMPY_SCALE.update((_torch().float32, _torch().float64))
    if t.dtype in _NUMPY_SCALE and t.is_cpu and t.is_contiguous():  # numpy: a third of torch's call cost
        a = t.numpy()
        np.multiply(a, f, out=a)  # float32 data times a Python float stays float32, as in torch
    elif t.dtype.is_floating_point:
        t.mul_(f)
    else:
        t.copy_(t.to(_torch().float64).mul_(f).trunc())
