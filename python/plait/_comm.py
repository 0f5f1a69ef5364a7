"""Communicator: the Python face of one native communicator (validation and data movement are C++)."""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any, Optional, Union

import numpy as np

from . import _C, _arrays, _errors, _gpu, _shm
from ._collv import VCollectives

_CODE = _C.COLLECTIVES
_ALLREDUCE, _REDUCE_SCATTER, _ALLGATHER = _CODE["allreduce"], _CODE["reduce_scatter"], _CODE["allgather"]
_BROADCAST, _REDUCE, _ALLTOALL = _CODE["broadcast"], _CODE["reduce"], _CODE["alltoall"]
_BARRIER, _SEND, _RECV = _CODE["barrier"], _CODE["send"], _CODE["recv"]
_NAME = {code: name for name, code in _CODE.items()}

_ndarray = np.ndarray
_fast_call = _C.fast_call
_fast_host = _C.fast_host
_torch_host = _arrays.torch_host


def _torch_fast(c, code, x, out, op, algorithm, root=0):
    """The small-message path of torch CPU tensors (see _arrays.torch_host): True if it ran."""
    hx = _torch_host(x)
    if hx is None:
        return False
    ho = hx if out is x else _torch_host(out)
    if ho is None or ho[2] != hx[2]:
        return False
    _fast_host(c, code, hx[0], hx[1], ho[0], ho[1], hx[2], op, algorithm, root)
    return True


DEFAULT_BUFFER_BYTES = 4 << 20
_RECORD = 256  # bytes of the split's segment announcement

# A buffer plait reads or writes: a numpy array, a torch tensor (CPU or CUDA), a cupy array or
# anything with __cuda_array_interface__ (plait._arrays says which are taken).
Array = Any
Timeout = Optional[float]  # seconds; None: the communicator's default; 0: fail if not ready now


def _cpus():
    # Online CPUs, not this process's affinity mask: a rank pinned to one core before init is
    # not oversubscribed when the job has a core per rank.
    return os.cpu_count() or 1


def segment_params(size, buffer_bytes):
    """(staging bytes per rank, send/recv slot bytes) for a communicator of `size` ranks."""
    if buffer_bytes is None:
        buffer_bytes = int(os.environ.get("PLAIT_BUFFER_BYTES", DEFAULT_BUFFER_BYTES))
    staging = max(8192, (int(buffer_bytes) + 4095) // 4096 * 4096)
    pair_slot = min(256 << 10, max(4096, staging // (4 * size))) // 64 * 64
    return staging, pair_slot


def flight_slots():
    """Flight records per rank for a new segment: PLAIT_FLIGHT=0 turns the recorder off,
    PLAIT_FLIGHT_SIZE sets the ring's length (default 256)."""
    if os.environ.get("PLAIT_FLIGHT", "1") == "0":
        return 0
    v = os.environ.get("PLAIT_FLIGHT_SIZE", "256")
    try:
        n = int(v)
    except ValueError:
        n = 0
    if not 1 <= n <= 1 << 16:
        raise _errors.InvalidArgument(f"PLAIT_FLIGHT_SIZE={v!r} is not a number of records in 1..65536")
    return n


def new_segment_info(size, buffer_bytes):
    staging, pair_slot = segment_params(size, buffer_bytes)
    return {
        "name": _shm.segment_name(),
        "size": size,
        "staging": staging,
        "pair_slot": pair_slot,
        "token": [secrets.randbits(64), secrets.randbits(64)],
        "flight": flight_slots(),
    }


def create_segment(info):
    return _C.create_segment(
        info["name"], info["size"], info["staging"], info["pair_slot"], *info["token"], info.get("flight", 0)
    )


def open_segment(info):
    return _C.open_segment(
        info["name"], info["size"], info["staging"], info["pair_slot"], *info["token"], info.get("flight", 0)
    )


def _leader_died(pid, wait_s=2.0):
    """Whether pid is dead, or dies within wait_s (a killed process is torn down gradually)."""
    deadline = time.monotonic() + wait_s
    while not _shm._dead(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _sweep_after(pid, wait_s=2.0):
    """Removes what a dead split leader (pid) left in /dev/shm: it is noticed gone as soon as its
    thread dies, while the kernel may still be tearing the process down (it is not yet "dead" to
    the sweep); a live leader unlinks its own segment."""
    if _leader_died(pid, wait_s):
        _shm.sweep_stale()


def close_all(things):
    """Closes what a communicator keeps alive (a rendezvous store server, a client, ...)."""
    for k in things:
        close = getattr(k, "close", None)
        if close:
            close()


class Handle:
    """An asynchronous call in flight. Keeps its arrays alive until it is finished."""

    __slots__ = ("_task", "_keep", "_result", "_comm")

    def __init__(self, task, keep, result, comm=None):
        self._task, self._keep, self._result = task, keep, result
        self._comm = comm  # the native communicator, which can run the call on the waiting thread

    def wait(self, timeout: Timeout = None) -> Any:
        """Blocks until the call has finished and returns its result; raises its error.

        `timeout` bounds only this wait (the call keeps its own deadline): when it passes first,
        plait.TimeoutError is raised and the call goes on.
        """
        wait_s = (
            None
            if timeout is None
            else _errors.seconds(
                timeout, "Handle.wait: timeout", "only look whether the call is done; None waits for it"
            )
        )
        # Unbounded waits only: running it here could outlast a bounded wait.
        if self._comm is not None and wait_s is None and not self._task.done():
            self._comm.run_here(self._task)  # saves the progress thread's wake-up (core/wakeup.h)
        if not self._task.wait(wait_s):
            raise _errors.TimeoutError(f"the call is still running after {timeout} s of waiting")
        self._keep = None
        return self._result

    def done(self) -> bool:
        return self._task.poll()


class Communicator(VCollectives):
    """A group of ranks that run collectives together over one shared-memory segment."""

    def __init__(self, native, *, timeout, buffer_bytes, world_size, keep=()):
        self._c = native
        self.rank = native.rank
        self.size = native.size
        self.timeout = timeout
        self._buffer_bytes = buffer_bytes
        self._world_size = world_size
        self._keep = list(keep)  # e.g. the rendezvous store server rank 0 hosts
        # (task, arrays) of async calls: the progress thread writes into the arrays until the call
        # is done, even if the caller dropped its Handle. After _c, so that when this object goes
        # away the native communicator finishes its calls before the arrays are freed.
        self._inflight = []
        self._gpu = None  # the GPU communicator, created by the first call with GPU arrays

    # -- internals ---------------------------------------------------------------------------
    def _call(self, code, x, out, op, root, peer, tag, algorithm, timeout, async_op, dtype, result):
        if (
            type(root) is not int
            or type(peer) is not int
            or type(tag) is not int
            or not (-(1 << 31) <= root < 1 << 31 and -(1 << 31) <= peer < 1 << 31)
        ):
            root, peer, tag = self._int(root, "root"), self._int(peer, "peer"), self._int(tag, "tag")
        if timeout is not None:
            # The type here; the value (NaN, negative) is checked with the other arguments in C++.
            try:
                timeout = _errors.number(timeout, "timeout")
            except _errors.InvalidArgument as e:
                self._c.fail(f"rank {self.rank}: {_NAME[code]}: {e}")
        if _gpu.wants_gpu(x, out):
            return _gpu.call(
                self, _NAME[code], x, out, op, algorithm, timeout, async_op, dtype, result, root, peer, tag
            )
        xo = out_o = None
        if x is not None and type(x) is not np.ndarray:
            xo = x
            x, d = self._np(x, "input")
            dtype = dtype or d
        if out is not None and type(out) is not np.ndarray:
            out_o = out
            out, d = self._np(out, "output")
            dtype = dtype or d
        t = self._c.call(code, x, out, op, root, peer, tag, algorithm, timeout, async_op, dtype or "")
        if async_op:
            keep = (x, out, xo, out_o)
            if len(self._inflight) >= 32:
                self._inflight = [p for p in self._inflight if not p[0].done()]
            self._inflight.append((t, keep))
            # sends and receives run in batches on the progress thread, never on the waiter's
            return Handle(t, keep, result, None if code == _SEND or code == _RECV else self._c)
        return result

    def _new_out(self, x, coll, shape=None):
        """A fresh output for x; input that is no array aborts the call on every rank."""
        if type(x) is not _ndarray:
            if not hasattr(x, "shape"):
                self._c.fail(
                    f"rank {self.rank}: input must be a numpy array or a torch CPU tensor, "
                    f"got {type(x).__name__}"
                )
            if _gpu.wants_gpu(x, None):
                _gpu.check_input(self, coll, x)
                try:
                    return _arrays.empty_like(x, None if shape is None else shape())
                except _errors.InvalidArgument as e:
                    self._c.fail(f"rank {self.rank}: {coll}: {e}")
            try:  # a buffer (memoryview) numpy cannot read fails the call everywhere, too
                return _arrays.empty_like(x, None if shape is None else shape())
            except _errors.InvalidArgument as e:
                self._c.fail(f"rank {self.rank}: {coll}: {e}")
        return _arrays.empty_like(x, None if shape is None else shape())

    def _int(self, v, name):
        """root / peer / tag as the C int the core takes; anything else aborts the call everywhere."""
        if type(v) is not int and not isinstance(v, (int, np.integer)):
            self._c.fail(f"rank {self.rank}: {name} must be an integer, got {type(v).__name__}")
        limit = 1 << 63 if name == "tag" else 1 << 31
        if not -limit <= int(v) < limit:
            self._c.fail(f"rank {self.rank}: {name} {v} is out of range")
        return int(v)

    def _np(self, obj, name):
        try:
            return _arrays.to_numpy(obj, name)
        except _errors.InvalidArgument as e:
            self._c.fail(f"rank {self.rank}: {e}")

    # -- collectives -------------------------------------------------------------------------
    def allreduce(
        self,
        x: Array,
        out: Optional[Array] = None,
        *,
        op: str = "sum",
        algorithm: str = "auto",
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: Optional[str] = None,
    ) -> Union[Array, Handle]:
        """out = x reduced over all ranks with `op`; `out=x` works in place."""
        if out is None:
            out = self._new_out(x, "allreduce")
        if (
            type(x) is _ndarray
            and type(out) is _ndarray
            and not async_op
            and dtype is None
            and timeout is None
        ):
            # The small-message path: one Python frame, then C++ without pybind11's dispatch.
            _fast_call(self._c, _ALLREDUCE, x, out, op, algorithm)
            return out
        if (
            not async_op
            and dtype is None
            and timeout is None
            and _torch_fast(self._c, _ALLREDUCE, x, out, op, algorithm)
        ):
            return out
        return self._call(_ALLREDUCE, x, out, op, 0, -1, 0, algorithm, timeout, async_op, dtype, out)

    def reduce_scatter(
        self,
        x: Array,
        out: Optional[Array] = None,
        *,
        op: str = "sum",
        algorithm: str = "auto",
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: Optional[str] = None,
    ) -> Union[Array, Handle]:
        """Block r of the reduced x (x holds `size` equal blocks) lands in rank r's out."""
        if out is None:
            out = self._new_out(x, "reduce_scatter", lambda: (_arrays.size_of(x) // self.size,))
        if (
            type(x) is _ndarray
            and type(out) is _ndarray
            and not async_op
            and dtype is None
            and timeout is None
        ):
            _fast_call(self._c, _REDUCE_SCATTER, x, out, op, algorithm)
            return out
        if (
            not async_op
            and dtype is None
            and timeout is None
            and _torch_fast(self._c, _REDUCE_SCATTER, x, out, op, algorithm)
        ):
            return out
        return self._call(_REDUCE_SCATTER, x, out, op, 0, -1, 0, algorithm, timeout, async_op, dtype, out)

    def allgather(
        self,
        x: Array,
        out: Optional[Array] = None,
        *,
        algorithm: str = "auto",
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: Optional[str] = None,
    ) -> Union[Array, Handle]:
        """out[r] = rank r's x; default out shape (size, *x.shape)."""
        if out is None:
            out = self._new_out(x, "allgather", lambda: (self.size,) + tuple(x.shape))
        if (
            type(x) is _ndarray
            and type(out) is _ndarray
            and not async_op
            and dtype is None
            and timeout is None
        ):
            _fast_call(self._c, _ALLGATHER, x, out, "sum", algorithm)
            return out
        if (
            not async_op
            and dtype is None
            and timeout is None
            and _torch_fast(self._c, _ALLGATHER, x, out, "sum", algorithm)
        ):
            return out
        return self._call(_ALLGATHER, x, out, "sum", 0, -1, 0, algorithm, timeout, async_op, dtype, out)

    def broadcast(
        self,
        x: Array,
        root: int = 0,
        *,
        out: Optional[Array] = None,
        algorithm: str = "auto",
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: Optional[str] = None,
    ) -> Union[Array, Handle]:
        """The root's x lands in every rank's out (x itself when out is None)."""
        if out is None:
            out = x
        if (
            type(x) is _ndarray
            and type(out) is _ndarray
            and not async_op
            and dtype is None
            and timeout is None
            and type(root) is int
            and -(1 << 31) <= root < 1 << 31
        ):
            _fast_call(self._c, _BROADCAST, x, out, "sum", algorithm, root)
            return out
        if (
            not async_op
            and dtype is None
            and timeout is None
            and type(root) is int
            and -(1 << 31) <= root < 1 << 31
            and _torch_fast(self._c, _BROADCAST, x, out, "sum", algorithm, root)
        ):
            return out
        return self._call(_BROADCAST, x, out, "sum", root, -1, 0, algorithm, timeout, async_op, dtype, out)

    def reduce(
        self,
        x: Array,
        root: int = 0,
        *,
        out: Optional[Array] = None,
        op: str = "sum",
        algorithm: str = "auto",
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: Optional[str] = None,
    ) -> Union[Array, Handle, None]:
        """The reduced x lands in the root's out; other ranks get None."""
        if self.rank == root and out is None:
            out = self._new_out(x, "reduce")
        if self.rank != root:
            out = None
        if (
            type(x) is _ndarray
            and (out is None or type(out) is _ndarray)
            and not async_op
            and dtype is None
            and timeout is None
            and type(root) is int
            and -(1 << 31) <= root < 1 << 31
        ):
            _fast_call(self._c, _REDUCE, x, out, op, algorithm, root)
            return out
        return self._call(_REDUCE, x, out, op, root, -1, 0, algorithm, timeout, async_op, dtype, out)

    def alltoall(
        self,
        x: Array,
        out: Optional[Array] = None,
        *,
        algorithm: str = "auto",
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: Optional[str] = None,
    ) -> Union[Array, Handle]:
        """Block j of x goes to rank j; block j of out came from rank j."""
        if out is None:
            out = self._new_out(x, "alltoall")
        if (
            type(x) is _ndarray
            and type(out) is _ndarray
            and not async_op
            and dtype is None
            and timeout is None
        ):
            _fast_call(self._c, _ALLTOALL, x, out, "sum", algorithm)
            return out
        return self._call(_ALLTOALL, x, out, "sum", 0, -1, 0, algorithm, timeout, async_op, dtype, out)

    def send(
        self,
        x: Array,
        peer: int,
        *,
        tag: int = 0,
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: Optional[str] = None,
    ) -> Optional[Handle]:
        """Sends x to `peer`; matched in order with that peer's recv of the same size and tag."""
        return self._call(_SEND, x, None, "sum", 0, peer, tag, "", timeout, async_op, dtype, None)

    def recv(
        self,
        out: Array,
        peer: int,
        *,
        tag: int = 0,
        timeout: Timeout = None,
        async_op: bool = False,
        dtype: Optional[str] = None,
    ) -> Union[Array, Handle]:
        """Receives into out from `peer`."""
        return self._call(_RECV, None, out, "sum", 0, peer, tag, "", timeout, async_op, dtype, out)

    def barrier(self, *, timeout: Timeout = None, async_op: bool = False) -> Optional[Handle]:
        return self._call(_BARRIER, None, None, "sum", 0, -1, 0, "auto", timeout, async_op, "", None)

    # -- groups ------------------------------------------------------------------------------
    def split(
        self, color: Optional[int], key: int = 0, *, buffer_bytes: Optional[int] = None
    ) -> Optional[Communicator]:
        """MPI_Comm_split: ranks with the same color form a communicator, ordered by (key, rank).

        Collective over this communicator. color None or < 0: this rank joins none (returns None).
        """
        if self.closed:
            raise _errors.PlaitError("communicator is finalized; split needs a live one")
        c = -1 if color is None or color < 0 else int(color)
        mine = np.array([c, int(key), self.rank, os.getpid()], dtype=np.int64)
        table = self.allgather(mine)
        members = sorted((int(k), int(r)) for cc, k, r, _ in table if cc == c) if c >= 0 else []
        record = np.zeros(_RECORD, dtype=np.uint8)
        info = failed = seg = None
        leader = members[0][1] if members else -1
        if leader == self.rank:
            try:
                info = new_segment_info(len(members), buffer_bytes or self._buffer_bytes)
                seg = create_segment(info)
                blob = json.dumps(info).encode()
            except Exception as e:  # noqa: BLE001 - e.g. /dev/shm full: the members hear why, not "left"
                failed = e
                text = str(e).encode("ascii", "replace")[: _RECORD - 80].decode()
                blob = json.dumps({"error": text, "kind": type(e).__name__}).encode()
            record[: len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        try:
            records = self.allgather(record)
        except BaseException as e:
            # A member died meanwhile: the new segment must not outlive this step. The leader
            # removes its own; the others sweep one a dead leader left behind.
            if seg is not None:
                seg.unlink()
            elif leader >= 0 and f"(pid {int(table[leader][3])})" in str(e):
                _sweep_after(int(table[leader][3]))
            raise
        if failed is not None:
            raise failed
        if c < 0:
            return None
        if seg is None:
            info = json.loads(records[leader].tobytes().rstrip(b"\0"))
            if "error" in info:
                cls = getattr(_errors, str(info.get("kind")), _errors.PlaitError)
                raise cls(
                    f"rank {self.rank}: split: rank {leader} could not create the new communicator: "
                    + info["error"]
                )
            try:
                seg = open_segment(info)
            except _errors.PlaitError as e:
                # Gone already: a leader killed after handing out its record had its segment swept
                # by a member that saw it die. That is the leader's loss, not a bad segment.
                pid = int(table[leader][3])
                if not _leader_died(pid):
                    raise
                raise _errors.PeerLostError(
                    f"rank {self.rank}: split: rank {leader} (pid {pid}), the leader of the new "
                    "communicator, died before this rank could open its segment"
                ) from e
        new_rank = [r for _, r in members].index(self.rank)
        pids = {int(r): int(pid) for _, _, r, pid in table}
        native = _C.Communicator(
            seg,
            new_rank,
            self.timeout,
            os.environ.get("PLAIT_ALGO", ""),
            self._world_size > _cpus(),
            self.timeout,
            peer_pids=[pids[r] for _, r in members],
        )
        return Communicator(
            native,
            timeout=self.timeout,
            buffer_bytes=buffer_bytes or self._buffer_bytes,
            world_size=self._world_size,
        )

    # -- lifetime ----------------------------------------------------------------------------
    @property
    def single_copy(self) -> bool:
        """Whether this communicator's ranks can read each other's memory directly (the
        "single_copy" algorithms); when False, `single_copy_unavailable` says why."""
        return self._c.single_copy

    @property
    def single_copy_unavailable(self) -> str:
        return self._c.single_copy_unavailable

    @property
    def mapped_bytes(self) -> int:
        """Bytes this rank has read from or written to peers through mapped plait.empty buffers
        (plain loads and stores, not kernel copies) since init."""
        return self._c.mapped_bytes

    @property
    def closed(self) -> bool:
        return self._c.closed

    @property
    def label(self) -> str:
        """This communicator's name in flight reports and traces (the torch backend sets its
        process group's name)."""
        return self._c.label

    @label.setter
    def label(self, value: str) -> None:
        self._c.label = str(value)

    def fail(self, message: str, kind: str = "invalid") -> None:
        """Aborts this communicator on every rank with `message` and raises it here: how a layer
        above (GPU arrays, a hierarchical communicator) rejects input so that no peer waits on a
        call this rank will never make. kind: "invalid" (InvalidArgument) or "mismatch"."""
        if kind not in ("invalid", "mismatch"):
            raise _errors.InvalidArgument(f"fail: kind must be 'invalid' or 'mismatch', not {kind!r}")
        self._c.fail(message, kind)

    def finalize(self) -> None:
        """Finishes queued calls and leaves; peers that wait on this rank afterwards get PeerLostError."""
        if self._gpu is not None:
            g, self._gpu = self._gpu, None
            g.finalize()
            _gpu.after_finalize(self, g)
        self._c.finalize()
        self._inflight = []
        close_all(self._keep)
        self._keep = []

    close = finalize

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finalize()

    def __repr__(self):
        return f"<plait.Communicator rank {self.rank} of {self.size}{' (finalized)' if self.closed else ''}>"
