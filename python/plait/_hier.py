"""Hierarchical communicator: plait's shared memory inside each host, an inter-host engine between.

At init every rank publishes its host identity (PLAIT_HOST_ID, else hostname + boot id) in the
rendezvous store. One host: plait.init returns the flat Communicator, unchanged. Several hosts:
it returns a HierCommunicator built from

    local   a plait shared-memory Communicator of the ranks of this host (local rank = order by
            global rank)
    inter   uniform layout (every host has L ranks): the shard group of local rank i, i.e. local
            rank i of every host, H ranks ordered by host. Otherwise: the leaders (local rank 0).
    world   an engine group of all ranks, for alltoall and send/recv between hosts.

Hosts are ordered by their lowest global rank. Ranks of a host need not be contiguous in global
order: results are placed by a permutation, so allgather and reduce_scatter keep global order.

Every call's first exchange on an engine group is one fixed-size frame per rank, allgathered: the
call's fingerprint (checked by every rank against every other's: a mismatch is a MismatchError on
every rank) and, when the engine payload is small (_ROOM bytes), the payload itself. So a small
call costs one engine message, check included; a larger one a header-only frame, then its data.

Allreduce, uniform layout (Horovod's and NCCL's pattern), N elements, f = N // L, r = N % L:
    small: the frame carries the input; local rank i reduces its shard group's inputs (one per
           host, in host order), then the host's ranks allreduce that in place
    1. local reduce_scatter of the first L*f elements: local rank i owns [i*f, (i+1)*f), summed
       over its host; the r left over are reduced to the last local rank, which owns them too
    2. inter allreduce of what rank i owns across the H hosts (shard group i)
    3. local allgather of the owned blocks (in place in the output), broadcast of the r left over
No count is padded. Avg sums everything, then divides once by the world size. Leaders layout:
local reduce to the leader, leaders' allreduce, local broadcast.

GPU arrays skip all of this: they go to one flat NCCL communicator of all ranks (plait._gpu), which
does its own steps inside and between hosts.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import struct
import threading
import time

import numpy as np

from . import _C, _comm, _errors, _gpu, _inter
from ._collv import VCollectives
from ._comm import Array, Handle, Timeout
from ._hosts import Layout


_FRAME = 2048  # bytes of every rank's first message of a call on an engine group (see _exchange)
_HDR = 64  # of which the header: magic, fingerprint, payload bytes (int64)
_ROOM = _FRAME - _HDR  # engine payloads up to this size travel in the frame itself
_MAGIC = 0x706C616974  # "plait"
_HEAD = struct.Struct("<8q")  # magic, the 6 fields of _fingerprint, payload bytes; fits in _HDR
_MAX_SRCS = 32  # most arrays _C.reduce_arrays combines in one pass


def _dtype_name(num):
    for t in set(np.sctypeDict.values()):
        if np.dtype(t).num == num:
            return np.dtype(t).name
    return f"code {num}"


class _Task:
    """What plait.Handle needs of a call in flight, over a concurrent.futures.Future."""

    __slots__ = ("_f",)

    def __init__(self, fut):
        self._f = fut

    def wait(self, timeout):
        try:
            # None: until done (Handle.wait checked the value); inf would overflow the lock's wait
            self._f.result(None if timeout is None or math.isinf(timeout) else timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def done(self):
        return self._f.done()

    poll = done


def _check_float(op, dtype, bf16, what):
    if op == "avg" and not (bf16 or dtype.kind == "f"):
        raise _errors.InvalidArgument(f"{what}: op avg needs a floating-point dtype, not {dtype}")


def _divide(a, n, bf16):
    """a /= n in place on plait's kernels (half types divided in float32, rounded once)."""
    _C.reduce_arrays(a, [a], "bfloat16" if bf16 else a.dtype.name, "avg", n)


def _aborts_on_error(method):
    """Bad arguments on one rank abort the call on every rank, as in the flat communicator."""
    import functools

    @functools.wraps(method)
    def wrapper(self, *args, **kw):
        try:
            return method(self, *args, **kw)
        except _errors.PlaitError as e:
            if self._error is None and not self._closed:
                self._abort_all(e)
            raise

    return wrapper


class HierCommunicator(VCollectives):
    """Same methods and semantics as plait.Communicator, for ranks that span hosts."""

    def __init__(self, rank, size, layout, local, inter, world, abort, *, timeout, engine, ctx, keep):
        self.rank, self.size, self.timeout = rank, size, float(timeout)
        self.layout, self.local, self.inter, self.world = layout, local, inter, world
        self.engine = engine
        self._abort, self._ctx, self._keep = abort, ctx, list(keep)
        self._error = None
        self._closed = False
        self._pool = None
        self._pending = 0
        self._lock = threading.Lock()
        self._nsplit = 0
        self._seq = 0  # calls issued, in issue order: the first field of the cross-host check
        self._check = os.environ.get("PLAIT_HIER_CHECK", "1") != "0"
        self._fbufs = {}  # id(engine group) -> its frame buffers (see _exchange)
        self._gpu = None  # the GPU communicator of all ranks, created by the first call with GPU arrays

    # -- plumbing ------------------------------------------------------------------------------
    def __repr__(self):
        return (
            f"<plait.HierCommunicator rank {self.rank} of {self.size}, host {self.layout.h} of "
            f"{self.layout.nhosts}, {self.engine} between hosts{' (finalized)' if self.closed else ''}>"
        )

    def fail(self, message: str, kind: str = "invalid") -> None:
        """As Communicator.fail: aborts on every rank of every host and raises."""
        cls = {"invalid": _errors.InvalidArgument, "mismatch": _errors.MismatchError}.get(kind)
        if cls is None:
            raise _errors.InvalidArgument(f"fail: kind must be 'invalid' or 'mismatch', not {kind!r}")
        err = cls(message)
        self._abort_all(err)
        raise err

    def _abort_all(self, err):
        if self._error is None:
            self._error = f"{type(err).__name__}: {err}"
            text = str(err)
            self._abort.set(
                err, text if text.startswith(f"rank {self.rank}") else f"rank {self.rank}: {text}"
            )
            try:
                # The host's peers raise the error's own class: a mismatch stays a MismatchError
                # whichever reaches them first, this abort or the job-wide flag.
                kind = "mismatch" if isinstance(err, _errors.MismatchError) else "invalid"
                self.local.fail(f"rank {self.rank} (hierarchical communicator): {err}", kind)
            except _errors.PlaitError:
                pass
            for g in (self.inter, self.world):
                if g is not None:
                    g.close(aborted=True)

    def _run(self, name, fn, timeout, async_op, keep=()):
        if self._closed:
            raise _errors.PlaitError(f"{name}: the communicator is finalized")
        # Raised here, a bad timeout aborts the call on every host (_aborts_on_error).
        budget = (
            self.timeout
            if timeout is None
            else _errors.seconds(
                timeout, f"rank {self.rank}: {name}: timeout", "fail at once if a peer is not there"
            )
        )

        def call():
            deadline = time.monotonic() + budget  # from when the call starts, as the flat path
            if self._error is not None:
                raise _errors.PlaitError(f"communicator aborted after an earlier error: {self._error}")
            try:
                return fn(deadline)
            except BaseException as e:
                if isinstance(e, _errors.PlaitError) and str(e).startswith("communicator aborted"):
                    raise
                if isinstance(e, _errors.PlaitError) and self._error is None:
                    # The local communicator reports a failure elsewhere as invalid usage: raise
                    # what the rank that failed first recorded (peer lost, timeout, ...).
                    first = self._abort.origin()
                    if first is not None and not first[1].startswith(f"rank {self.rank}:"):
                        e = first[0](f"rank {self.rank}: {name}: another rank failed: {first[1]}")
                if (
                    isinstance(e, _errors.PlaitError)
                    and "inter-host" not in str(e)
                    and "another rank failed" not in str(e)
                ):
                    lay = self.layout  # the local communicator names its own ranks
                    e = type(e)(
                        f"{e} [host {lay.h}: local ranks 0..{len(lay.hosts[lay.h]) - 1} are "
                        f"global ranks {lay.hosts[lay.h]}]"
                    )
                self._abort_all(e)
                if isinstance(e, _errors.PlaitError):
                    raise e
                raise _errors.PlaitError(f"rank {self.rank}: {name}: {type(e).__name__}: {e}") from e

        if not async_op and self._pending == 0:
            return call()
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plait-hier")
            self._pending += 1
        fut = self._pool.submit(call)
        fut.add_done_callback(self._done)
        if not async_op:
            return fut.result()
        from ._comm import Handle

        return Handle(_Task(fut), keep, None), fut

    def _done(self, _):
        with self._lock:
            self._pending -= 1

    _FIELDS = ("call number", "collective", "count", "dtype", "op", "root")
    _OPS = tuple(sorted(_C.OPS, key=_C.OPS.get))  # the core's reduction codes, in their order

    def _fingerprint(self, name, count, dtype, bf16=False, op="sum", root=-1):
        """What ranks on every host must agree on; the local communicator checks its own host."""
        self._seq += 1
        code = 1000 if bf16 else np.dtype(dtype).num
        ops = self._OPS.index(op) if op in self._OPS else -1
        return (self._seq, int(_comm._CODE.get(name, 99)), int(count), code, ops, int(root))

    # -- the cross-host check, folded into the first engine message of every call ----------------
    # Every call's first exchange on an engine group is an allgather of one fixed-size frame per
    # rank: a header (magic, the call's fingerprint, payload bytes) and, for calls whose engine
    # payload fits (_ROOM bytes), the data itself. The frame's size never depends on the call, so
    # ranks that make different calls still exchange it and every rank of the group compares every
    # header before any data is used: a mismatch is a MismatchError, never wrong data or a hang in
    # an engine collective of mismatched sizes. Small calls pay no extra round trip; a larger call
    # sends a header-only frame first (one small-message latency, small beside its data) and then
    # the data in the engine's own collective.
    def _frames(self, group):
        """(send frame, receive frames) of an engine group, made on first use."""
        bufs = self._fbufs.get(id(group))
        if bufs is None:
            bufs = (np.zeros(_FRAME, dtype=np.uint8), np.zeros(group.size * _FRAME, dtype=np.uint8))
            self._fbufs[id(group)] = bufs
        return bufs

    def _room(self, group):
        """The payload area of this rank's next frame on group (_ROOM bytes): fill, then _exchange."""
        return self._frames(group)[0][_HDR:]

    def _exchange(self, group, fp, nbytes, deadline):
        """Allgathers this rank's frame (header + the first nbytes of _room) over group and checks
        every header; returns the members' payloads, (group size, nbytes) uint8 in group order.
        nbytes None: the check alone, skipped when PLAIT_HIER_CHECK=0 or the rank has no group."""
        return self._post(group, fp, nbytes, deadline)()

    def _post(self, group, fp, nbytes, deadline):
        """_exchange in two halves: starts the frame's allgather and returns what waits for it and
        checks (a large call runs its first local step in between, hiding the header's trip)."""
        if group is None or (nbytes is None and not self._check):
            return lambda: None
        send, recv = self._frames(group)
        _HEAD.pack_into(send, 0, _MAGIC, *fp, nbytes or 0)
        wait = group.start_allgather(send, recv, deadline)

        def finish():
            wait()
            if self._check:  # every member's header, byte for byte (a few us in all)
                mine, got = memoryview(send)[: _HEAD.size], memoryview(recv)
                for j in range(group.size):
                    if got[j * _FRAME : j * _FRAME + _HEAD.size] != mine:
                        self._mismatch(group, fp, _HEAD.unpack_from(recv, j * _FRAME), j)
            return recv.reshape(group.size, _FRAME)[:, _HDR : _HDR + (nbytes or 0)]

        return finish

    def _mismatch(self, group, fp, theirs, j):
        lay, peer = self.layout, group.ranks[j]

        def call(f):
            name = _comm._NAME.get(int(f[1]), f"collective code {f[1]}")
            dt = "bfloat16" if f[3] == 1000 else _dtype_name(int(f[3]))
            op = self._OPS[f[4]] if 0 <= f[4] < len(self._OPS) else "-"
            return f"{name} #{f[0]} (count {f[2]}, dtype {dt}, op {op}, root {f[5]})"

        if theirs[0] != _MAGIC:
            what = "sent something that is not a plait call frame"
        else:
            f = [int(v) for v in theirs[1 : len(fp) + 1]]
            diff = ", ".join(n for n, a, b in zip(self._FIELDS, fp, f) if a != b) or "payload size"
            what = f"called {call(f)} (they differ in {diff})"
        raise _errors.MismatchError(
            f"rank {self.rank}: mismatched calls across hosts: this rank (host {lay.h}) called "
            f"{call(fp)} but rank {peer} (host {lay.host_of[peer]}) of its inter-host {self.engine} "
            f"group {what}"
        )

    def _combine(self, out, rows, op, bf16, part=slice(None)):
        """out = the members' payloads reduced in group (host) order on plait's kernels, the same
        bytes on every rank; avg divides by the world size in the same pass."""
        srcs = [r.view(out.dtype)[part] for r in rows]
        kind = "bfloat16" if bf16 else out.dtype.name
        _C.reduce_arrays(out, srcs, kind, op, self.size if op == "avg" else 0)

    def _async(self, name, fn, timeout, async_op, result, keep):
        r = self._run(name, fn, timeout, async_op, keep)
        if not async_op:
            return result
        h, _ = r
        h._result = result
        return h

    @staticmethod
    def _left(deadline):
        return max(deadline - time.monotonic(), 0.001)

    def _arr(self, obj, name, dtype=None, writable=False):
        """(flat numpy view, dtype name for the local comm, bf16) of a numpy array / torch tensor."""
        from . import _arrays

        a, d = _arrays.to_numpy(obj, name)
        bf16 = (dtype or d) == "bfloat16" or a.dtype.name == "bfloat16"
        if a.dtype.name == "bfloat16":
            a = a.view(np.uint16)
        if not a.flags.c_contiguous:
            raise _errors.InvalidArgument(f"rank {self.rank}: {name} is not C-contiguous")
        if writable and not a.flags.writeable:
            raise _errors.InvalidArgument(f"rank {self.rank}: {name} is read-only")
        return a.reshape(-1), ("bfloat16" if bf16 else None), bf16

    def _new_out(self, x, shape):
        from . import _arrays

        if type(x) is not np.ndarray and not hasattr(x, "shape"):
            raise _errors.InvalidArgument(
                f"rank {self.rank}: input must be a numpy array or a torch CPU tensor, got {type(x).__name__}"
            )
        return _arrays.empty_like(x, shape)

    def _gpu_out(self, x, coll, shape=None):
        """A fresh output like a GPU input, after the checks that input must pass first."""
        from . import _arrays

        _gpu.check_input(self, coll, x)
        try:
            return _arrays.empty_like(x, shape)
        except _errors.InvalidArgument as e:
            self.fail(f"rank {self.rank}: {coll}: {e}")

    def _on_gpu(self, coll, x, out, op, algorithm, timeout, async_op, dtype, result, root=0, peer=-1, tag=0):
        """GPU arrays, before any numpy conversion: plait._gpu's checks and call, as on the flat path."""
        if self._closed:
            raise _errors.PlaitError(f"{coll}: the communicator is finalized")
        if self._error is not None:
            raise _errors.PlaitError(f"communicator aborted after an earlier error: {self._error}")
        return _gpu.call(
            self, coll, x, out, op, algorithm, timeout, async_op, dtype, result, root=root, peer=peer, tag=tag
        )

    # -- collectives ---------------------------------------------------------------------------
    @_aborts_on_error
    def allreduce(
        self,
        x: Array,
        out: Array = None,
        *,
        op: str = "sum",
        algorithm: str = "auto",
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: str | None = None,
    ) -> Array | Handle:
        if _gpu.wants_gpu(x, out):
            out = self._gpu_out(x, "allreduce") if out is None else out
            return self._on_gpu("allreduce", x, out, op, algorithm, timeout, async_op, dtype, out)
        if out is None:
            out = self._new_out(x, None)
        xa, dt, bf16 = self._arr(x, "input", dtype)
        oa = self._arr(out, "output", dtype, writable=True)[0]
        if oa.size != xa.size or oa.dtype != xa.dtype:
            raise _errors.InvalidArgument(
                f"rank {self.rank}: allreduce: output has {oa.size} {oa.dtype}, input {xa.size} {xa.dtype}"
            )
        _check_float(op, xa.dtype, bf16, f"rank {self.rank}: allreduce")
        fp = self._fingerprint("allreduce", xa.size, xa.dtype, bf16, op)
        return self._async(
            "allreduce",
            lambda d: self._allreduce(xa, oa, op, dt, bf16, fp, d),
            timeout,
            async_op,
            out,
            (x, out),
        )

    def _small(self, nbytes, group):
        """Whether a call's engine payload travels in its frame (the same answer on every rank of
        the group for the same call)."""
        return nbytes <= _ROOM and group is not None and group.size <= _MAX_SRCS

    def _allreduce(self, x, out, op, dt, bf16, fp, deadline):
        n, L, lay = x.size, self.local.size, self.layout
        red = "sum" if op == "avg" else op
        if lay.uniform:
            if self._small(x.nbytes, self.inter):
                # Small: the input itself is the payload. Local rank i sums its shard group's inputs
                # (the same bytes on every host: same data, host order), then the host's ranks sum
                # those in place. One engine message, one local step; the check comes first.
                self._room(self.inter)[: x.nbytes] = x.view(np.uint8)
                rows = self._exchange(self.inter, fp, x.nbytes, deadline)
                if n:
                    self._combine(out, rows, red, bf16)
                self.local.allreduce(out, out, op=red, dtype=dt, timeout=self._left(deadline))
                if op == "avg" and n:
                    _divide(out, self.size, bf16)
                return out
            checked = self._post(self.inter, fp, None, deadline)  # waited for after the local step
            # Local rank i owns elements [i*f, (i+1)*f), the last one also the n % L left over, so
            # no count is padded: the even part is reduce-scattered and allgathered in place in
            # out, the tail reduced to and broadcast from the last local rank.
            f, r = divmod(n, L)
            lo, hi = lay.i * f, (lay.i + 1) * f
            if f:
                self.local.reduce_scatter(
                    x[: L * f], out[lo:hi], op=red, dtype=dt, timeout=self._left(deadline)
                )
            if r:
                last = lay.i == L - 1
                self.local.reduce(
                    x[L * f :],
                    L - 1,
                    out=out[L * f :] if last else None,
                    op=red,
                    dtype=dt,
                    timeout=self._left(deadline),
                )
                hi = n if last else hi
            checked()
            self.inter.allreduce(out[lo:hi], red, deadline, bf16)
            if op == "avg" and hi > lo:
                _divide(out[lo:hi], self.size, bf16)
            if f:
                self.local.allgather(
                    out[lay.i * f : (lay.i + 1) * f], out[: L * f], dtype=dt, timeout=self._left(deadline)
                )
            if r:
                self.local.broadcast(out[L * f :], L - 1, dtype=dt, timeout=self._left(deadline))
            return out
        leader, small = lay.i == 0, self._small(x.nbytes, self.inter)
        checked = None if small else self._post(self.inter, fp, None, deadline)  # the leaders' check
        self.local.reduce(x, 0, out=out if leader else None, op=red, dtype=dt, timeout=self._left(deadline))
        if leader:
            if small:
                self._room(self.inter)[: x.nbytes] = out.view(np.uint8)
                rows = self._exchange(self.inter, fp, x.nbytes, deadline)
                if n:
                    self._combine(out, rows, op, bf16)
            else:
                checked()
                self.inter.allreduce(out, red, deadline, bf16)
                if op == "avg":
                    _divide(out, self.size, bf16)
        self.local.broadcast(out, 0, dtype=dt, timeout=self._left(deadline))
        return out

    @_aborts_on_error
    def reduce_scatter(
        self,
        x: Array,
        out: Array = None,
        *,
        op: str = "sum",
        algorithm: str = "auto",
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: str | None = None,
    ) -> Array | Handle:
        from . import _arrays

        if _gpu.wants_gpu(x, out):
            if out is None:
                out = self._gpu_out(x, "reduce_scatter", (_arrays.size_of(x) // self.size,))
            return self._on_gpu("reduce_scatter", x, out, op, algorithm, timeout, async_op, dtype, out)
        if out is None:
            out = self._new_out(x, (_arrays.size_of(x) // self.size,))
        xa, dt, bf16 = self._arr(x, "input", dtype)
        oa = self._arr(out, "output", dtype, writable=True)[0]
        if xa.size != oa.size * self.size or oa.dtype != xa.dtype:
            raise _errors.InvalidArgument(
                f"rank {self.rank}: reduce_scatter: input has {xa.size} {xa.dtype}, output {oa.size} "
                f"{oa.dtype}; the input needs size ({self.size}) x output elements"
            )
        _check_float(op, xa.dtype, bf16, f"rank {self.rank}: reduce_scatter")
        fp = self._fingerprint("reduce_scatter", oa.size, xa.dtype, bf16, op)
        return self._async(
            "reduce_scatter",
            lambda d: self._reduce_scatter(xa, oa, op, dt, bf16, fp, d),
            timeout,
            async_op,
            out,
            (x, out),
        )

    def _reduce_scatter(self, x, out, op, dt, bf16, fp, deadline):
        m, lay = out.size, self.layout
        if m == 0:
            self._exchange(self.inter, fp, None, deadline)
            self.local.barrier(timeout=self._left(deadline))
            return out
        red = "sum" if op == "avg" else op
        if not lay.uniform:
            full = np.empty_like(x)
            self._allreduce(x, full, op, dt, bf16, fp, deadline)
            out[...] = full[self.rank * m : (self.rank + 1) * m]
            return out
        H = lay.nhosts
        small = self._small(H * m * x.itemsize, self.inter)
        checked = None if small else self._post(self.inter, fp, None, deadline)  # waited for below
        # y[i, h] = block of rank (h, i): hosts interleaved in rank order need no reordering copy
        y = x if lay.in_order else x.reshape(self.size, m)[lay.perm].reshape(-1)
        z = self._room(self.inter)[: H * m * x.itemsize].view(x.dtype) if small else np.empty(H * m, x.dtype)
        self.local.reduce_scatter(y, z, op=red, dtype=dt, timeout=self._left(deadline))
        if small:
            # every host's H blocks in the frame; this rank reduces block h of each, into out
            rows = self._exchange(self.inter, fp, z.nbytes, deadline)
            self._combine(out, rows, op, bf16, slice(lay.h * m, (lay.h + 1) * m))
            return out
        checked()
        # The engines have no reduce-scatter in our interface: allreduce all H blocks, keep ours
        # (H x the bytes of an inter-host reduce-scatter; see docs/api.md).
        self.inter.allreduce(z, red, deadline, bf16)
        mine = z[lay.h * m : (lay.h + 1) * m]
        if op == "avg":
            _divide(mine, self.size, bf16)
        out[...] = mine
        return out

    @_aborts_on_error
    def allgather(
        self,
        x: Array,
        out: Array = None,
        *,
        algorithm: str = "auto",
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: str | None = None,
    ) -> Array | Handle:
        if _gpu.wants_gpu(x, out):
            if out is None:
                out = self._gpu_out(x, "allgather", (self.size,) + tuple(x.shape))
            return self._on_gpu("allgather", x, out, "sum", algorithm, timeout, async_op, dtype, out)
        if out is None:
            out = self._new_out(x, (self.size,) + tuple(x.shape))
        xa = self._arr(x, "input", dtype)[0]
        oa = self._arr(out, "output", dtype, writable=True)[0]
        if oa.size != xa.size * self.size or oa.dtype != xa.dtype:
            raise _errors.InvalidArgument(
                f"rank {self.rank}: allgather: output has {oa.size} {oa.dtype}, "
                f"input {xa.size} {xa.dtype}; the output needs size x input"
            )
        fp = self._fingerprint("allgather", xa.size, xa.dtype)
        return self._async(
            "allgather",
            lambda d: self._allgather(xa.view(np.uint8), oa.view(np.uint8), fp, d),
            timeout,
            async_op,
            out,
            (x, out),
        )

    def _allgather(self, x, out, fp, deadline):
        n, lay, H = x.size, self.layout, self.layout.nhosts
        if n == 0:
            self._exchange(self.inter, fp, None, deadline)
            self.local.barrier(timeout=self._left(deadline))
            return out
        if lay.uniform:
            L = self.local.size
            if self._small(n, self.inter):
                self._room(self.inter)[:n] = x
                a = np.ascontiguousarray(self._exchange(self.inter, fp, n, deadline))
            else:
                self._exchange(self.inter, fp, None, deadline)
                a = np.empty(H * n, dtype=np.uint8)
                self.inter.allgather(x, a, deadline)  # a[h] = x of rank (h, i)
            b = out if lay.in_order else np.empty(L * H * n, dtype=np.uint8)
            self.local.allgather(a, b, timeout=self._left(deadline))  # b[i, h] = x of rank (h, i)
            if b is not out:
                out.reshape(self.size, n)[lay.perm] = b.reshape(L * H, n)
            return out
        # Leaders: host h's ranks' inputs in slot h of `every`, slots of the largest host's size
        # (the slack of smaller hosts is carried, not filled with data).
        lmax, mn = max(len(m) for m in lay.hosts), self.local.size * n
        every = np.empty((H, lmax * n), dtype=np.uint8)
        small = lay.i == 0 and self._small(lmax * n, self.inter)
        # the leader's own slot: its frame (small), a separate send buffer (large); others' output
        # is overwritten by the broadcast below
        mine = (
            self._room(self.inter)[: lmax * n]
            if small
            else np.empty(lmax * n, dtype=np.uint8)
            if lay.i == 0
            else every[lay.h]
        )
        checked = None if small else self._post(self.inter, fp, None, deadline)  # the leaders' check
        self.local.allgather(x, mine[:mn], timeout=self._left(deadline))
        if lay.i == 0:
            mine[mn:] = 0  # the slack of a smaller host: no stale bytes leave the host
            if small:
                every[...] = self._exchange(self.inter, fp, lmax * n, deadline)
            else:
                checked()
                self.inter.allgather(mine, every, deadline)
        self.local.broadcast(every, 0, timeout=self._left(deadline))
        dst = out.reshape(self.size, n)
        for h, members in enumerate(lay.hosts):
            dst[members] = every[h, : len(members) * n].reshape(len(members), n)
        return out

    @_aborts_on_error
    def broadcast(
        self,
        x: Array,
        root: int = 0,
        *,
        out: Array = None,
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: str | None = None,
    ) -> Array | Handle:
        if out is None:
            out = x
        root = self._peer(root, "root", allow_self=True)
        if _gpu.wants_gpu(x, out):
            return self._on_gpu("broadcast", x, out, "sum", "auto", timeout, async_op, dtype, out, root=root)
        xa = self._arr(x, "input", dtype)[0]
        oa = self._arr(out, "output", dtype, writable=True)[0]
        if oa.size != xa.size or oa.dtype != xa.dtype:
            raise _errors.InvalidArgument(
                f"rank {self.rank}: broadcast: output has {oa.size} {oa.dtype}, input {xa.size} {xa.dtype}"
            )
        fp = self._fingerprint("broadcast", xa.size, xa.dtype, root=root)
        return self._async(
            "broadcast",
            lambda d: self._broadcast(xa.view(np.uint8), oa.view(np.uint8), root, fp, d),
            timeout,
            async_op,
            out,
            (x, out),
        )

    def _inter_broadcast(self, out, hr, fp, deadline):
        """Host hr's out (uint8 bytes view or array) to the other hosts over the inter group, check
        included: in the call's frame when it fits, else a header-only frame, then the engine."""
        k = out.nbytes
        if self._small(k, self.inter):
            if self.layout.h == hr:
                self._room(self.inter)[:k] = out.view(np.uint8).reshape(-1)
            rows = self._exchange(self.inter, fp, k, deadline)
            if self.layout.h != hr:
                out.view(np.uint8).reshape(-1)[...] = rows[hr]
        else:
            self._exchange(self.inter, fp, None, deadline)
            self.inter.broadcast(out, hr, deadline)

    def _broadcast(self, x, out, root, fp, deadline):
        lay, k = self.layout, out.size
        hr, ir = lay.host_of[root], lay.local_of[root]
        if self.rank == root and out is not x:
            out[...] = x
        if lay.uniform:
            checked = lambda: None  # noqa: E731
            if lay.i != ir:  # not in the root's shard group: the check alone, beside the local step
                checked = self._post(self.inter, fp, None, deadline)
            else:
                self._inter_broadcast(out, hr, fp, deadline)
            if k:
                self.local.broadcast(out, ir, timeout=self._left(deadline))
            else:
                self.local.barrier(timeout=self._left(deadline))
            checked()
            return out
        if k and lay.h == hr and ir != 0:
            self.local.broadcast(out, ir, timeout=self._left(deadline))
        if lay.i == 0:
            self._inter_broadcast(out, hr, fp, deadline)
        if not k:
            self.local.barrier(timeout=self._left(deadline))
        elif lay.h != hr or ir == 0:
            self.local.broadcast(out, 0, timeout=self._left(deadline))
        return out

    @_aborts_on_error
    def reduce(
        self,
        x: Array,
        root: int = 0,
        *,
        out: Array = None,
        op: str = "sum",
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: str | None = None,
    ) -> Array | Handle | None:
        root = self._peer(root, "root", allow_self=True)
        if self.rank == root and out is None:
            out = self._new_out(x, None)
        if self.rank != root:
            out = None
        if _gpu.wants_gpu(x, out):
            return self._on_gpu("reduce", x, out, op, "auto", timeout, async_op, dtype, out, root=root)
        xa, dt, bf16 = self._arr(x, "input", dtype)
        oa = self._arr(out, "output", dtype, writable=True)[0] if out is not None else None
        if oa is not None and (oa.size != xa.size or oa.dtype != xa.dtype):
            raise _errors.InvalidArgument(
                f"rank {self.rank}: reduce: output has {oa.size} {oa.dtype}, input {xa.size} {xa.dtype}"
            )
        _check_float(op, xa.dtype, bf16, f"rank {self.rank}: reduce")

        fp = self._fingerprint("reduce", xa.size, xa.dtype, bf16, op, root)

        def run(d):
            # a reduce costs an allreduce across hosts; the other ranks' result is dropped
            self._allreduce(xa, oa if oa is not None else np.empty_like(xa), op, dt, bf16, fp, d)
            return out

        return self._async("reduce", run, timeout, async_op, out, (x, out))

    @_aborts_on_error
    def alltoall(
        self,
        x: Array,
        out: Array = None,
        *,
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: str | None = None,
    ) -> Array | Handle:
        if _gpu.wants_gpu(x, out):
            out = self._gpu_out(x, "alltoall") if out is None else out
            return self._on_gpu("alltoall", x, out, "sum", "auto", timeout, async_op, dtype, out)
        if out is None:
            out = self._new_out(x, None)
        xa = self._arr(x, "input", dtype)[0]
        oa = self._arr(out, "output", dtype, writable=True)[0]
        if oa.size != xa.size or xa.size % self.size or oa.dtype != xa.dtype:
            raise _errors.InvalidArgument(
                f"rank {self.rank}: alltoall: input {xa.size} {xa.dtype}, output "
                f"{oa.size} {oa.dtype}; sizes must match and divide by {self.size}"
            )

        fp = self._fingerprint("alltoall", xa.size, xa.dtype)

        def run(d):
            src, dst = xa.view(np.uint8), oa.view(np.uint8)
            if self._small(src.size, self.world):
                # every rank's whole input in its frame; this rank keeps its block of each
                blk = src.size // self.size
                self._room(self.world)[: src.size] = src
                rows = self._exchange(self.world, fp, src.size, d)
                dst.reshape(self.size, blk)[...] = rows[:, self.rank * blk : (self.rank + 1) * blk]
                return out
            self._exchange(self.world, fp, None, d)
            if np.shares_memory(src, dst):
                src = src.copy()
            self.world.alltoall(src, dst, d)
            return out

        return self._async("alltoall", run, timeout, async_op, out, (x, out))

    @_aborts_on_error
    def send(
        self,
        x: Array,
        peer: int,
        *,
        tag: int = 0,
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: str | None = None,
    ) -> Handle | None:
        peer = self._peer(peer, "peer")
        if _gpu.wants_gpu(x, None):
            return self._on_gpu(
                "send", x, None, "sum", "", timeout, async_op, dtype, None, peer=peer, tag=tag
            )
        xa, dt, _ = self._arr(x, "input", dtype)
        return self._async(
            "send", lambda d: self._p2p(True, xa, dt, peer, tag, d), timeout, async_op, None, (x,)
        )

    @_aborts_on_error
    def recv(
        self,
        out: Array,
        peer: int,
        *,
        tag: int = 0,
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: str | None = None,
    ) -> Array | Handle:
        peer = self._peer(peer, "peer")
        if _gpu.wants_gpu(None, out):
            return self._on_gpu(
                "recv", None, out, "sum", "", timeout, async_op, dtype, out, peer=peer, tag=tag
            )
        oa, dt, _ = self._arr(out, "output", dtype, writable=True)
        return self._async(
            "recv", lambda d: self._p2p(False, oa, dt, peer, tag, d), timeout, async_op, out, (out,)
        )

    def _p2p(self, sending, a, dt, peer, tag, deadline):
        lay = self.layout
        if lay.host_of[peer] == lay.h:
            fn = self.local.send if sending else self.local.recv
            return fn(a, lay.local_of[peer], tag=tag, dtype=dt, timeout=self._left(deadline))
        if not -(1 << 31) <= int(tag) < 1 << 31:
            raise _errors.InvalidArgument(f"rank {self.rank}: tag {tag} between hosts must fit in 32 bits")
        fn = self.world.send if sending else self.world.recv
        fn(a.view(np.uint8), peer, int(tag) & 0x7FFFFFFF, deadline)
        return None

    def _peer(self, v, name, allow_self=False):
        if (
            not isinstance(v, (int, np.integer))
            or not 0 <= int(v) < self.size
            or (not allow_self and int(v) == self.rank)
        ):
            err = _errors.InvalidArgument(
                f"rank {self.rank}: {name} {v!r} is not another rank of {self.size}"
                if not allow_self
                else f"rank {self.rank}: {name} {v!r} is not a rank of {self.size}"
            )
            self._abort_all(err)
            raise err
        return int(v)

    def barrier(self, *, timeout: Timeout = None, async_op: bool = False) -> Handle | None:
        fp = self._fingerprint("barrier", 0, np.uint8)

        def run(d):
            self.local.barrier(timeout=self._left(d))
            if self.inter is not None:  # the frame exchange is the barrier between hosts
                self._exchange(self.inter, fp, 0, d)
            self.local.barrier(timeout=self._left(d))

        return self._async("barrier", run, timeout, async_op, None, ())

    # -- groups and lifetime -------------------------------------------------------------------
    def split(
        self, color: int | None, key: int = 0, *, buffer_bytes: int | None = None
    ) -> HierCommunicator | None:
        """MPI_Comm_split over the hosts: the new communicator is flat when its ranks share a host."""
        if self.closed:
            raise _errors.PlaitError("communicator is finalized; split needs a live one")
        c = -1 if color is None or color < 0 else int(color)
        table = self.allgather(np.array([c, int(key), self.rank], dtype=np.int64))
        members = sorted((int(k), int(r)) for cc, k, r in table if cc == c) if c >= 0 else []
        n = self._nsplit
        self._nsplit += 1
        ctx = dict(self._ctx)
        if self.engine == "mpi":
            from mpi4py import MPI

            sub = self._ctx["mpi_world"].Split(c if c >= 0 else MPI.UNDEFINED, int(key))
            ctx["mpi_world"] = sub
        if c < 0:
            return None
        new_rank = [r for _, r in members].index(self.rank)
        return ctx["init_in"](  # _bootstrap.init_in, handed in by create: no import back up
            ctx["client"],
            f"{ctx['prefix']}/split{n}/{c}",
            new_rank,
            len(members),
            timeout=self.timeout,
            init_timeout=max(self.timeout, 60.0),
            buffer_bytes=buffer_bytes or ctx.get("buffer_bytes"),
            keep=[],
            ctx=ctx,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def finalize(self) -> None:
        if self._closed:
            return
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._closed = True
        if self._gpu is not None:  # before the local communicator its abort coupling refers to
            g, self._gpu = self._gpu, None
            g.finalize()
        self.local.finalize()
        for g in (self.inter, self.world):
            if g is not None:
                g.close(aborted=self._error is not None)
        _comm.close_all(self._keep)
        self._keep = []

    close = finalize

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finalize()


def create(client, prefix, rank, size, ids, *, timeout, init_timeout, buffer_bytes, keep, ctx, join_local):
    """The HierCommunicator of this rank. ids: every rank's (host id, machine id). ctx["init_in"]
    is the rendezvous (_bootstrap.init_in) that split joins its new communicators through."""
    lay = Layout([h for h, _ in ids], rank)
    ctx = dict(ctx or {})
    torch_store = ctx.get("torch_store")
    if torch_store is None and hasattr(client, "_torch"):
        torch_store = client._torch
        ctx["torch_store"] = torch_store
    engine = ctx.get("engine") or _inter.choose(torch_store)
    if engine is None:
        raise _inter.no_engine_error(rank, lay.nhosts)
    ctx.update(engine=engine, client=client, prefix=prefix, buffer_bytes=buffer_bytes)
    same_machine = sum(1 for _, m in ids if m == ids[rank][1])
    local_ranks = lay.hosts[lay.h]
    local = join_local(f"{prefix}/h{lay.h}", lay.i, len(local_ranks), same_machine > _comm._cpus())
    abort = _inter.Abort(client, prefix)
    try:
        if lay.uniform:
            inter_ranks = [m[lay.i] for m in lay.hosts]
            inter_name, inter_rank = f"shard{lay.i}", lay.h
        else:
            inter_ranks = [m[0] for m in lay.hosts]
            inter_name, inter_rank = "leaders", lay.h if lay.i == 0 else None
        if engine == "gloo":
            store = torch_store
            if store is None:
                store = ctx.get("c10d_store") or _inter.c10d_store_for(client, rank, prefix, init_timeout)
                ctx["c10d_store"] = store
            from torch._C._distributed_c10d import PrefixStore

            store = PrefixStore(prefix, store)
            world = _inter.GlooGroup(store, "world", rank, size, range(size), abort, timeout)
            inter = (
                None
                if inter_rank is None
                else _inter.GlooGroup(
                    store, inter_name, inter_rank, len(inter_ranks), inter_ranks, abort, timeout
                )
            )
        else:
            from mpi4py import MPI

            wcomm = ctx.get("mpi_world") or MPI.COMM_WORLD
            if wcomm.Get_size() != size or wcomm.Get_rank() != rank:
                raise _errors.InvalidArgument(
                    f"rank {rank}: the MPI engine needs plait's ranks to be MPI's (MPI rank "
                    f"{wcomm.Get_rank()} of {wcomm.Get_size()}, plait rank {rank} of {size}); "
                    f"set PLAIT_INTER=gloo or leave RANK/WORLD_SIZE to mpirun"
                )
            ctx["mpi_world"] = wcomm
            world = _inter.MpiGroup(wcomm.Dup(), range(size), abort, "world")
            sub = wcomm.Split(lay.i if lay.uniform else (0 if lay.i == 0 else MPI.UNDEFINED), lay.h)
            inter = None if sub == MPI.COMM_NULL else _inter.MpiGroup(sub, inter_ranks, abort, inter_name)
    except BaseException:
        local.finalize()
        raise
    return HierCommunicator(
        rank, size, lay, local, inter, world, abort, timeout=timeout, engine=engine, ctx=ctx, keep=keep
    )
