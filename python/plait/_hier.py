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

Allreduce, uniform layout (Horovod's and NCCL's pattern), N elements, c = ceil(N/L):
    1. local reduce_scatter: local rank i owns chunk i (c elements) summed over its host
    2. inter allreduce of chunk i across the H hosts (shard group i): c elements each
    3. local allgather of the chunks
Avg sums everything, then divides once by the world size. Leaders layout: local reduce to the
leader, leaders' allreduce, local broadcast.

GPU arrays skip all of this: they go to one flat NCCL communicator of all ranks (plait._gpu), which
does its own steps inside and between hosts.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
import time

import numpy as np

from . import _C, _comm, _errors, _gpu, _inter
from ._comm import Array, Handle, Timeout
from ._hosts import Layout


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


class HierCommunicator:
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
                self.local.fail(f"rank {self.rank} (hierarchical communicator): {err}")
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
    _OPS = ("sum", "prod", "min", "max", "avg")

    def _fingerprint(self, name, count, dtype, bf16=False, op="sum", root=-1):
        """What ranks on every host must agree on; the local communicator checks its own host."""
        self._seq += 1
        code = 1000 if bf16 else np.dtype(dtype).num
        ops = self._OPS.index(op) if op in self._OPS else -1
        return (self._seq, int(_comm._CODE.get(name, 99)), int(count), code, ops, int(root))

    def _check_hosts(self, name, fp, deadline):
        """Ranks on different hosts must make the same call: one tiny max-allreduce of (fp, -fp)
        over the engine group this rank uses between hosts; all agree iff max(fp) == min(fp)."""
        group = self.world if name == "alltoall" else self.inter
        if group is None or not self._check:
            return
        k = len(fp)
        v = np.array(list(fp) + [-f for f in fp], dtype=np.int64)
        group.allreduce(v, "max", deadline, False)
        hi, lo = v[:k], -v[k:]
        if (hi == lo).all():
            return
        diff = ", ".join(f"{f} ({lo[j]}..{hi[j]})" for j, f in enumerate(self._FIELDS) if hi[j] != lo[j])
        raise _errors.MismatchError(
            f"rank {self.rank}: mismatched calls across hosts: this rank (host {self.layout.h}) called "
            f"{name} #{fp[0]} (count={fp[2]}, dtype code {fp[3]}, op {fp[4]}, root {fp[5]}) but a rank "
            f"of another host in its {self.engine} group disagrees in {diff}"
        )

    def _async(self, name, fn, timeout, async_op, result, keep, fp=None):
        if fp is not None:
            call = fn
            fn = lambda d: (self._check_hosts(name, fp, d), call(d))[1]  # noqa: E731
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
        return self._async(
            "allreduce",
            lambda d: self._allreduce(xa, oa, op, dt, bf16, d),
            timeout,
            async_op,
            out,
            (x, out),
            self._fingerprint("allreduce", xa.size, xa.dtype, bf16, op),
        )

    def _allreduce(self, x, out, op, dt, bf16, deadline):
        n, L, lay = x.size, self.local.size, self.layout
        red = "sum" if op == "avg" else op
        if n == 0:
            return self.local.allreduce(x, out, op=red, dtype=dt, timeout=self._left(deadline))
        if lay.uniform:
            c = -(-n // L)
            buf = out if c * L == n else np.zeros(c * L, dtype=x.dtype)
            if buf is not out:
                buf[:n] = x
            src = x if buf is out else buf
            shard = buf[lay.i * c : (lay.i + 1) * c]
            self.local.reduce_scatter(src, shard, op=red, dtype=dt, timeout=self._left(deadline))
            self.inter.allreduce(shard, red, deadline, bf16)
            if op == "avg":
                _divide(shard, self.size, bf16)
            self.local.allgather(shard, buf, dtype=dt, timeout=self._left(deadline))
            if buf is not out:
                out[...] = buf[:n]
            return out
        else:
            leader = lay.i == 0
            self.local.reduce(
                x, 0, out=out if leader else None, op=red, dtype=dt, timeout=self._left(deadline)
            )
            if leader:
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
        return self._async(
            "reduce_scatter",
            lambda d: self._reduce_scatter(xa, oa, op, dt, bf16, d),
            timeout,
            async_op,
            out,
            (x, out),
            self._fingerprint("reduce_scatter", oa.size, xa.dtype, bf16, op),
        )

    def _reduce_scatter(self, x, out, op, dt, bf16, deadline):
        m, lay = out.size, self.layout
        if m == 0:
            self.local.barrier(timeout=self._left(deadline))
            return out
        red = "sum" if op == "avg" else op
        if lay.uniform:
            H = lay.nhosts
            y = x.reshape(self.size, m)[lay.perm].reshape(-1)  # y[i, h] = block of rank (h, i)
            z = np.empty(H * m, dtype=x.dtype)
            self.local.reduce_scatter(y, z, op=red, dtype=dt, timeout=self._left(deadline))
            # The engines have no reduce-scatter in our interface: allreduce all H blocks, keep ours
            # (H x the bytes of an inter-host reduce-scatter; see docs/api.md).
            self.inter.allreduce(z, red, deadline, bf16)
            mine = z[lay.h * m : (lay.h + 1) * m]
        else:
            full = np.empty_like(x)
            self._allreduce(x, full, red, dt, bf16, deadline)
            mine = full[self.rank * m : (self.rank + 1) * m]
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
        return self._async(
            "allgather",
            lambda d: self._allgather(xa.view(np.uint8), oa.view(np.uint8), d),
            timeout,
            async_op,
            out,
            (x, out),
            self._fingerprint("allgather", xa.size, xa.dtype),
        )

    def _allgather(self, x, out, deadline):
        n, lay, H = x.size, self.layout, self.layout.nhosts
        if n == 0:
            self.local.barrier(timeout=self._left(deadline))
            return out
        if lay.uniform:
            L = self.local.size
            a = np.empty(H * n, dtype=np.uint8)
            self.inter.allgather(x, a, deadline)  # a[h] = x of rank (h, i)
            b = np.empty(L * H * n, dtype=np.uint8)
            self.local.allgather(a, b, timeout=self._left(deadline))  # b[i, h] = x of rank (h, i)
            out.reshape(self.size, n)[lay.perm] = b.reshape(L * H, n)
            return out
        lmax = max(len(m) for m in lay.hosts)
        mine = np.zeros(lmax * n, dtype=np.uint8)
        self.local.allgather(x, mine[: self.local.size * n], timeout=self._left(deadline))
        every = np.empty(H * lmax * n, dtype=np.uint8)
        if lay.i == 0:
            self.inter.allgather(mine, every, deadline)
        self.local.broadcast(every, 0, timeout=self._left(deadline))
        rows, dst = every.reshape(H, lmax, n), out.reshape(self.size, n)
        for h, members in enumerate(lay.hosts):
            dst[members] = rows[h, : len(members)]
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
        return self._async(
            "broadcast",
            lambda d: self._broadcast(xa.view(np.uint8), oa.view(np.uint8), root, d),
            timeout,
            async_op,
            out,
            (x, out),
            self._fingerprint("broadcast", xa.size, xa.dtype, root=root),
        )

    def _broadcast(self, x, out, root, deadline):
        lay = self.layout
        hr, ir = lay.host_of[root], lay.local_of[root]
        if self.rank == root and out is not x:
            out[...] = x
        if out.size == 0:
            self.local.barrier(timeout=self._left(deadline))
            return out
        if lay.uniform:
            if lay.i == ir:
                self.inter.broadcast(out, hr, deadline)
            self.local.broadcast(out, ir, timeout=self._left(deadline))
            return out
        if lay.h == hr and ir != 0:
            self.local.broadcast(out, ir, timeout=self._left(deadline))
        if lay.i == 0:
            self.inter.broadcast(out, hr, deadline)
        if lay.h != hr or ir == 0:
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

        def run(d):
            tmp = np.empty_like(xa)
            self._allreduce(xa, tmp, op, dt, bf16, d)  # a reduce costs an allreduce across hosts
            if oa is not None:
                oa[...] = tmp
            return out

        return self._async(
            "reduce",
            run,
            timeout,
            async_op,
            out,
            (x, out),
            self._fingerprint("reduce", xa.size, xa.dtype, bf16, op, root),
        )

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

        def run(d):
            src = xa.view(np.uint8)
            if np.shares_memory(src, oa):
                src = src.copy()
            self.world.alltoall(src, oa.view(np.uint8), d)
            return out

        return self._async(
            "alltoall",
            run,
            timeout,
            async_op,
            out,
            (x, out),
            self._fingerprint("alltoall", xa.size, xa.dtype),
        )

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
        def run(d):
            self.local.barrier(timeout=self._left(d))
            if self.inter is not None:
                self.inter.barrier(d)
            self.local.barrier(timeout=self._left(d))

        return self._async(
            "barrier", run, timeout, async_op, None, (), self._fingerprint("barrier", 0, np.uint8)
        )

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
        from ._bootstrap import init_in

        new_rank = [r for _, r in members].index(self.rank)
        return init_in(
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
    """The HierCommunicator of this rank. ids: every rank's (host id, machine id)."""
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
