"""ProcessGroupPlait: a torch.distributed ProcessGroup whose collectives run on one plait communicator.

A Python subclass of c10d's ProcessGroup (not of Backend, which Python cannot subclass), so the
same wheel works across torch versions without compiling against torch's C++ ABI. Every method
turns torch's arguments into plait calls issued in program order on the caller's thread; plait
runs them in that order on its progress thread (or inline, for a synchronous call), and the
group's completion thread (_work.py) completes each Work and its Future.
"""

import itertools
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

import plait
from plait._gpu import GpuHandle as _GpuHandle

from . import _errors, _reduce, _tensors
from ._errors import PlaitUnsupportedError
from ._p2p import Exchanges, one as _one, root_of as _root
from ._reduce import Red
from ._store import TorchStore
from ._work import Completer, Work, _Op, completed

_ZERO = timedelta(0)
_AllreduceOptions = dist.AllreduceOptions
_ids = itertools.count()
_live = weakref.WeakSet()  # groups not shut down yet (released at exit, see __init__.py)


class Options:
    """pg_options for init_process_group / new_group with backend "plait".

    buffer_bytes: shared staging bytes per rank of the group's communicator (default
    PLAIT_BUFFER_BYTES, else 4 MiB).
    """

    def __init__(self, buffer_bytes=None):
        self.buffer_bytes = buffer_bytes


def _as_list(tensors):
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


def _red(opts):
    if opts is None:
        return Red(dist.ReduceOp.SUM)
    return Red(getattr(opts, "reduceOp", opts))  # options, or a bare ReduceOp (pg.allreduce(t, op))


class ProcessGroupPlait(Exchanges, dist.ProcessGroup):
    """One process group on one plait communicator, made from torch's store for that group."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, store, rank, size, timeout, group_id=None, options=None, comm=None):
        super().__init__(rank, size)
        self._rank, self._size = rank, size  # pybind's rank()/size() cost ~1 us a call
        self._store = store
        self._comm = None
        self._group_desc = "undefined"
        self.setGroupName(group_id if group_id is not None else f"plait{next(_ids)}")
        secs = timeout.total_seconds() if timeout is not None else None
        self._timeout_s = None  # per-call deadline: None = the communicator's (init's timeout)
        self._seq = 0
        self._last = None
        self._coalesce_from = None
        buffer_bytes = options.buffer_bytes if isinstance(options, Options) else None
        try:
            self._comm = (
                comm
                if comm is not None
                else plait.init(
                    rank,
                    size,
                    store=TorchStore(store, secs),
                    timeout=secs,
                    init_timeout=secs,
                    buffer_bytes=buffer_bytes,
                    set_default=False,
                )
            )
        except plait.PlaitError as e:
            raise _errors.to_torch(e, f"plait: creating {self._label}") from None
        self._name_comm()
        self._completer = Completer(f"plait-torch-{self._group_name}")
        _live.add(self)

    # -- identity, as c10d, functional collectives and DeviceMesh ask for it -------------------
    def getBackendName(self):
        return "plait"

    name = _get_backend_name = getBackendName

    def setGroupName(self, name):
        self._group_name = str(name)
        self._label = f"group {self._group_name!r} (rank {self._rank} of {self._size})"
        self._name_comm()

    def _name_comm(self):
        # Flight reports and PLAIT_TRACE tracks show the process group's name.
        if getattr(self._comm, "label", None) is not None:
            self._comm.label = f"pg:{self._group_name}"

    def getGroupName(self):
        return self._group_name

    def setGroupDesc(self, desc):
        self._group_desc = str(desc)

    def getGroupDesc(self):
        return self._group_desc

    _set_group_name = setGroupName
    _set_group_desc = setGroupDesc

    @property
    def group_name(self):
        return self._group_name

    @property
    def group_desc(self):
        return self._group_desc

    @property
    def _device_types(self):
        if plait.build_info()["cuda"] and torch.cuda.is_available():
            return [torch.device("cpu"), torch.device("cuda")]
        return [torch.device("cpu")]

    def _get_backend(self, device):
        return self  # this group is its own backend on every device it is asked about

    def get_group_store(self):
        return self._store

    def set_timeout(self, timeout):
        self._timeout_s = timeout.total_seconds()

    def _set_sequence_number_for_group(self):
        pass

    def _get_sequence_number_for_group(self):
        return self._seq

    # -- lifetime ------------------------------------------------------------------------------
    def shutdown(self):
        """Finishes the calls in flight, then releases the communicator and the thread."""
        comm, self._comm = self._comm, None
        if comm is None:
            return
        _live.discard(self)
        try:
            comm.finalize()
        finally:
            self._completer.close(timeout_s=60)

    abort = shutdown

    def split_group(self, *args, **kwargs):
        raise PlaitUnsupportedError("plait groups cannot split_group(): use dist.new_group(ranks)")

    def merge_remote_group(self, *args, **kwargs):
        raise PlaitUnsupportedError("plait groups cannot merge_remote_group()")

    def _start_coalescing(self, device):
        self._coalesce_from = self._seq

    def _end_coalescing(self, device):
        issued = self._coalesce_from is not None and self._seq > self._coalesce_from
        self._coalesce_from = None
        # ops complete in issue order, so the last one's Work stands for all of them
        return Work(self._last if issued else completed("coalesced", []))

    # -- plumbing ------------------------------------------------------------------------------
    def _begin(self, what, value):
        if self._comm is None:
            raise _errors.PlaitBackendError(f"plait {what} on {self._label}: the group was shut down")
        self._seq += 1
        return _Op(f"plait {what} on {self._label}", value)

    def _kw(self, opts, sync):
        """Keyword arguments of the plait calls of one op: deadline and async_op."""
        t = getattr(opts, "timeout", None)
        secs = t.total_seconds() if t is not None and t > _ZERO else self._timeout_s
        return {"timeout": secs, "async_op": not sync}

    @staticmethod
    def _sync(opts):
        """Whether the caller waits right away (dist.* with async_op=False): then the plait calls
        run inline on this thread, with no thread hop. C++ callers leave asyncOp True."""
        return opts is not None and not getattr(opts, "asyncOp", True)

    def _launch(self, op, kw):
        """The Work of an op whose plait calls are all issued."""
        if kw["async_op"] and op.handles and not op.cuda():  # CUDA ops complete in stream order, here
            self._completer.submit(op)
        else:
            op.finish()
            if op._error is not None:
                raise op._error
        self._last = op
        return Work(op)

    @staticmethod
    def _add(op, h):
        if isinstance(h, (plait.Handle, _GpuHandle)):
            op.handles.append(h)

    def _gpu_call(self, op, coll, x, y, kw, red=None):
        """A CUDA tensor collective: plait's GPU path on torch's current stream, with no temporaries
        (a synchronous call returns once it is enqueued, as NCCL's do; the Work of an async one
        completes when the stream has run it)."""
        if not (x.is_cuda and y.is_cuda):
            self._fail(f"{coll}: input on {x.device}, output on {y.device}; pass both on one device")
        if not (x.is_contiguous() and y.is_contiguous()):
            raise PlaitUnsupportedError(f"{op.where}: non-contiguous CUDA tensors (call .contiguous())")
        kwargs = dict(kw)
        if red is not None:
            fast = _reduce.FAST.get((red.kind.value, x.dtype))
            if fast is None:
                raise PlaitUnsupportedError(
                    f"{op.where}: {red} on {x.dtype} CUDA tensors (plait's GPU path "
                    f"reduces sum/prod/min/max, avg on floats, of its dtypes)"
                )
            kwargs["op"] = fast[0]
        self._add(op, getattr(self._comm, coll)(x, y, **kwargs))

    def _gpu_reduce(self, op, x, y, red, kw, root):
        """reduce of a CUDA tensor to `root` (y is written on the root only)."""
        if not (x.is_cuda and y.is_cuda):
            self._fail(f"reduce: input on {x.device}, output on {y.device}; pass both on one device")
        if not (x.is_contiguous() and y.is_contiguous()):
            raise PlaitUnsupportedError(f"{op.where}: non-contiguous CUDA tensors (call .contiguous())")
        fast = _reduce.FAST.get((red.kind.value, x.dtype))
        if fast is None:
            raise PlaitUnsupportedError(
                f"{op.where}: {red} on {x.dtype} CUDA tensors (plait's GPU path "
                f"reduces sum/prod/min/max, avg on floats, of its dtypes)"
            )
        out = y.reshape(-1) if self._rank == root else None
        self._add(op, self._comm.reduce(x.reshape(-1), root, out=out, op=fast[0], **kw))

    @staticmethod
    def _cuda_bytes(t, where):
        """A contiguous CUDA tensor's bytes as a flat uint8 CUDA view (data movement: any dtype)."""
        if not t.is_contiguous():
            raise PlaitUnsupportedError(f"{where}: non-contiguous CUDA tensors (call .contiguous())")
        return _tensors.raw(t)

    def _fail(self, msg):
        """Aborts the communicator on every rank (so no peer hangs) and raises InvalidArgument."""
        msg = f"rank {self._rank}: {msg}"
        # Communicator.fail and HierCommunicator.fail both abort every rank (of every host) and
        # raise here; a multi-host group has no flat _c to fail on.
        self._comm.fail(msg)
        raise plait.InvalidArgument(msg)  # not reached: fail raises

    # -- reductions ----------------------------------------------------------------------------
    def _reduce_into(self, op, x, y, red, kw, *, root=None, scatter=False):
        """Issues one reduction of x into y: allreduce, reduce to root, or reduce_scatter."""
        if x.is_cuda and root is None:
            return self._gpu_call(op, "reduce_scatter" if scatter else "allreduce", x, y, kw, red)
        if x.is_cuda:
            return self._gpu_reduce(op, x, y, red, kw, root)
        _tensors.check_cpu(x, op.where)
        rank = self._rank
        if root is not None and rank != root:
            y = torch.empty_like(x)  # not written on non-roots (torch leaves their tensor alone)
        if red.gathers:
            return self._reduce_by_gather(op, x, y, red, kw, root=root, scatter=scatter)
        ok = (lambda s, d: _tensors.is_block(d, s, rank)) if scatter else (lambda s, d: False)
        src, dst, name = _reduce.plan(x, y, red, self._size, op, ok)
        xs, dt = _tensors.np_of(src)
        ys = _tensors.np_of(dst)[0]
        comm = self._comm
        if scatter:
            self._add(op, comm.reduce_scatter(xs, ys, op=name, dtype=dt, **kw))
        elif root is None:
            self._add(op, comm.allreduce(xs, ys, op=name, dtype=dt, **kw))
        else:
            self._add(op, comm.reduce(xs, root, out=ys if rank == root else None, op=name, dtype=dt, **kw))

    def _reduce_by_gather(self, op, x, y, red, kw, *, root, scatter):
        src = _tensors.source(x)
        stack = torch.empty((self._size,) + tuple(src.shape), dtype=src.dtype)
        self._add(op, self._comm.allgather(_tensors.bytes_of(src), _tensors.bytes_of(stack), **kw))
        rank = self._rank

        def finish():
            r = _reduce.gathered(stack, red)
            if scatter:
                m = y.numel()
                r = r.reshape(-1)[rank * m : (rank + 1) * m]
            y.copy_(r.view(y.shape))

        op.after.append(finish)

    def allreduce(self, tensors, opts=None):
        # The fast path (one contiguous CPU tensor of a plait dtype, an op plait has): what DDP
        # buckets and most dist.all_reduce calls are. Everything else goes through plan().
        if (
            type(opts) is _AllreduceOptions
            and type(tensors) is list
            and len(tensors) == 1
            and self._comm is not None
        ):
            t = tensors[0]
            fast = _reduce.FAST.get((opts.reduceOp.op.value, t.dtype))
            if fast is not None and t.is_cpu and t.is_contiguous():
                name, dt = fast
                x = _tensors.window(t)
                sync = not opts.asyncOp
                secs = opts.timeout.total_seconds()
                self._seq += 1
                try:
                    h = self._comm.allreduce(
                        x,
                        x,
                        op=name,
                        dtype=dt,
                        async_op=not sync,
                        timeout=secs if secs > 0 else self._timeout_s,
                    )
                except plait.PlaitError as e:
                    raise _errors.to_torch(e, f"plait allreduce on {self._label}") from None
                if sync:
                    op = completed(self._label, tensors)
                else:
                    op = _Op(f"plait allreduce on {self._label}", tensors)
                    op.handles.append(h)
                    self._completer.submit(op)
                self._last = op
                return Work(op)
        return self._allreduce(tensors, opts)

    @_errors.mapped
    def _allreduce(self, tensors, opts=None):
        tensors = _as_list(tensors)
        red = _red(opts)
        op = self._begin("allreduce", tensors)
        kw = self._kw(opts, self._sync(opts))
        for t in tensors:
            self._reduce_into(op, t, t, red, kw)
        return self._launch(op, kw)

    allreduce_coalesced = _allreduce

    @_errors.mapped
    def reduce(self, tensors, opts=None):
        t = _one(tensors, "reduce")
        op = self._begin("reduce", [t])
        kw = self._kw(opts, self._sync(opts))
        self._reduce_into(op, t, t, _red(opts), kw, root=_root(opts))
        return self._launch(op, kw)

    @_errors.mapped
    def reduce_scatter_single(self, output, input, opts=None):
        op = self._begin("reduce_scatter_single", [output])
        kw = self._kw(opts, self._sync(opts))
        self._reduce_scatter_one(op, output, input, _red(opts), kw)
        return self._launch(op, kw)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_one(self, op, output, input, red, kw):
        if input.numel() != output.numel() * self._size:
            self._fail(
                f"reduce_scatter: input has {input.numel()} elements, output {output.numel()}; "
                f"the input needs group size ({self._size}) x output elements"
            )
        x = _tensors.source(input).reshape(-1)
        if output.is_contiguous():
            self._reduce_into(op, x, output.reshape(-1), red, kw, scatter=True)
        else:
            tmp = torch.empty(output.numel(), dtype=output.dtype)
            self._reduce_into(op, x, tmp, red, kw, scatter=True)
            op.after.append(lambda: output.copy_(tmp.view(output.shape)))

    @_errors.mapped
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = self._begin("reduce_scatter_single_coalesced", list(outputs))
        kw = self._kw(opts, self._sync(opts))
        red = _red(opts)
        for out, inp in zip(outputs, inputs):
            self._reduce_scatter_one(op, out, inp, red, kw)
        return self._launch(op, kw)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @_errors.mapped
    def reduce_scatter(self, outputs, input_lists, opts=None):
        out = _one(outputs, "reduce_scatter")
        ins = input_lists[0]
        op = self._begin("reduce_scatter", [out])
        kw = self._kw(opts, self._sync(opts))
        red = _red(opts)
        if len(ins) != self._size:
            self._fail(f"reduce_scatter: {len(ins)} inputs for a group of {self._size}")
        if all(t.numel() == out.numel() for t in ins):
            flat = _tensors.flat_view(ins)
            if flat is None:
                flat = torch.cat([t.reshape(-1) for t in ins])
            self._reduce_scatter_one(op, out, flat, red, kw)
        else:  # uneven blocks: one reduce per block, rooted at the rank that keeps it
            for r, t in enumerate(ins):
                self._reduce_into(op, t, out, red, kw, root=r)
        return self._launch(op, kw)

    # -- broadcast and gathers -----------------------------------------------------------------
    @_errors.mapped
    def broadcast(self, tensors, opts=None):
        t = _one(tensors, "broadcast")
        op = self._begin("broadcast", [t])
        kw = self._kw(opts, self._sync(opts))
        self._broadcast_one(op, t, _root(opts), kw)
        return self._launch(op, kw)

    def _broadcast_one(self, op, t, root, kw):
        if t.is_cuda:
            self._add(op, self._comm.broadcast(self._cuda_bytes(t, op.where), root, **kw))
            return
        _tensors.check_cpu(t, op.where)
        buf = _tensors.source(t)
        if buf is not t and self._rank != root:
            op.after.append(lambda: t.copy_(buf))
        self._add(op, self._comm.broadcast(_tensors.bytes_of(buf), root, **kw))

    @_errors.mapped
    def all_gather_single(self, output, input, opts=None):
        op = self._begin("all_gather_single", [output])
        kw = self._kw(opts, self._sync(opts))
        self._allgather_one(op, output, input, kw)
        return self._launch(op, kw)

    _allgather_base = all_gather_single

    def _allgather_one(self, op, output, input, kw):
        if input.is_cuda:
            if output.numel() != input.numel() * self._size:
                self._fail(
                    f"all_gather: output has {output.numel()} elements, input {input.numel()}; "
                    f"the output needs group size ({self._size}) x input elements"
                )
            return self._gpu_call(op, "allgather", input.reshape(-1), output.reshape(-1), kw)
        _tensors.check_cpu(input, op.where)
        if output.numel() != input.numel() * self._size:
            self._fail(
                f"all_gather: output has {output.numel()} elements, input {input.numel()}; "
                f"the output needs group size ({self._size}) x input elements"
            )
        dst = _tensors.sink(output, op)
        src = _tensors.source(input)
        if src is input and _tensors.overlaps(src, dst) and not _tensors.is_block(src, dst, self._rank):
            src = src.clone()
        self._add(op, self._comm.allgather(_tensors.bytes_of(src), _tensors.bytes_of(dst), **kw))

    @_errors.mapped
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        op = self._begin("all_gather_single_coalesced", list(outputs))
        kw = self._kw(opts, self._sync(opts))
        for out, inp in zip(outputs, inputs):
            self._allgather_one(op, out, inp, kw)
        return self._launch(op, kw)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_errors.mapped
    def allgather(self, output_lists, inputs, opts=None):
        x = _one(inputs, "allgather")
        outs = output_lists[0]
        op = self._begin("allgather", output_lists)
        kw = self._kw(opts, self._sync(opts))
        n, me = self._size, self._rank
        if len(outs) != n:
            self._fail(f"all_gather: {len(outs)} outputs for a group of {n}")
        if all(t.numel() == x.numel() for t in outs):
            flat = _tensors.flat_view(outs) if all(t.dtype == x.dtype for t in outs) else None
            if flat is None:
                flat = torch.empty((n,) + tuple(x.shape), dtype=x.dtype)
                op.after.append(lambda: [o.copy_(flat[r].view(o.shape)) for r, o in enumerate(outs)])
            self._allgather_one(op, flat, x, kw)
        else:  # uneven sizes: each rank broadcasts its own
            src = _tensors.source(x)
            for r, o in enumerate(outs):
                if r == me:
                    self._add(op, self._comm.broadcast(_tensors.bytes_of(src), r, **kw))
                else:
                    self._broadcast_one(op, o, r, kw)
            op.after.append(lambda: outs[me].copy_(src.view(outs[me].shape)))
        return self._launch(op, kw)

    @_errors.mapped
    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """output_lists[r][i] = rank r's inputs[i]: one allgather of all the inputs' bytes."""
        op = self._begin("allgather_coalesced", output_lists)
        kw = self._kw(opts, self._sync(opts))
        parts = [_tensors.raw(_tensors.source(t)) for t in inputs]
        src = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        stack = torch.empty((self._size, src.numel()), dtype=torch.uint8)
        self._add(op, self._comm.allgather(_tensors.bytes_of(src), _tensors.bytes_of(stack), **kw))

        def unpack():
            for r, outs in enumerate(output_lists):
                off = 0
                for o, p in zip(outs, parts):
                    _tensors.write_bytes(o, stack[r, off : off + p.numel()])
                    off += p.numel()

        op.after.append(unpack)
        return self._launch(op, kw)

    @_errors.mapped
    def barrier(self, opts=None):
        op = self._begin("barrier", [])
        kw = self._kw(opts, self._sync(opts))
        self._add(op, self._comm.barrier(**kw))
        return self._launch(op, kw)

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        self.barrier(opts).wait()

    def __repr__(self):
        return f"<ProcessGroupPlait {self._label}{'' if self._comm is not None else ' (shut down)'}>"


def shutdown_all():
    """Releases every group still alive (at interpreter exit, when nobody destroyed them)."""
    for g in list(_live):
        try:
            g.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
