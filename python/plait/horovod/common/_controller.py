"""The coordinator of plait.horovod: Horovod's controller, built on plait collectives.

Every process runs cycles in lock-step with the others. One cycle:
  1. exchange: each rank sends the requests it submitted since its last cycle (kind, name, dtype,
     shape, op, root, scale factors, splits, process set) in one plait allgather of a fixed frame
     (a second allgather only when a rank has more to say than the frame holds);
  2. every rank adds every rank's requests to one table, in rank order, so all tables are equal;
  3. a name is ready when every member of its process set has submitted it (or has joined); the
     ready names, in table order, are checked against each other (a mismatch fails that name on
     every rank, and nothing else) and run with plait collectives (common/_execute.py fuses them).
Because the ready list is a pure function of the equal tables, every rank runs the same plait
calls in the same order, whatever order the ranks submitted in. Time-based decisions (a stall
warning, a name that waited past its deadline) are made by rank 0 alone and travel in its next
request list, so they too land on every rank in the same cycle.

Cycles run on a background thread every HOROVOD_CYCLE_TIME ms, and on the thread that waits for a
handle (synchronize), which spares a thread wake-up per call; a lock keeps them one at a time.
A cycle whose only request is a cached allreduce with a kept plan runs in one native call
(common/_fastpath.py).
"""

import json
import os
import sys
import threading
import time

import numpy as np

from . import _device
from ._fastpath import FastPath
from .exceptions import HorovodInternalError

_FRAME = 1024  # bytes per rank in the first allgather of a cycle: the common case fits one call
_MAX_SLOTS = (_FRAME - 8) // 4  # cached requests a binary frame holds
_UNCACHED = ("barrier", "add_ps", "rm_ps")  # kinds whose names never repeat
_JOIN = "join"


def env_float(name, default):
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not a number") from None


class Op:
    """One submission of this rank: the request it sends and what runs it here."""

    __slots__ = (
        "req", "tensor", "output", "done", "error", "result", "finish", "t_submit", "layout", "device",
        "ready", "gpu_done",
    )  # fmt: skip

    def __init__(self, req, tensor, output=None, finish=None):
        self.req = req  # [kind, name, ps, dtype, shape, op, root, pre, post, splits(, device)]
        self.device = req[10] if len(req) > 10 else _device.CPU  # a CUDA device index, or -1
        self.ready = self.gpu_done = None  # CUDA events (common/_device.py)
        self.tensor, self.output, self.finish = tensor, output, finish
        self.done = False
        self.error = None
        self.result = None
        self.t_submit = time.monotonic()
        self.layout = None  # a grouped allreduce's fusion layout (common/_fusion.py)


class Controller(FastPath):
    def __init__(self, comm, rank, size, process_sets, executor, timeline=None):
        self.comm, self.rank, self.size = comm, rank, size
        self.process_sets = process_sets  # id -> ProcessSet (ranks, communicator)
        self.executor = executor
        self.timeline = timeline
        self.cycle_s = env_float("HOROVOD_CYCLE_TIME", 1.0) / 1000.0
        self.stall_s = env_float("HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0)
        self.stall_check = os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "0") not in ("1", "true")
        shutdown_s = env_float("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0)
        self.deadline_s = shutdown_s if shutdown_s > 0 else float(getattr(comm, "timeout", 300.0))
        self._queue = []  # Ops not yet sent
        self._mine = {}  # (ps, name) -> Op sent and not finished
        self._table = {}  # (ps, name) -> {rank: req}, in the order all ranks add them
        self._first_seen = {}  # rank 0 only: (ps, name) -> monotonic time it entered the table
        self._warned = set()
        self._joined = {}  # rank -> cycle it joined
        self._join_op = None
        self.join_device = _device.CPU  # where a joined rank makes its zeros of GPU ops (join(device))
        self._cycle_no = 0
        self._frame = self._frames = None  # the first allgather's send and receive buffers
        self.fast = None  # the native cycle (csrc/torch/horovod_fast.cc), once the executor has one
        self._plans = {}  # (ps, name) -> (native plan, group layout or None, cached request)
        self.fast_cycles = 0  # cycles the native call ran whole (tests and benchmarks read it)
        # Horovod's response cache: a request every rank made alike before travels as its slot
        # number. Slots are handed out in the order names run (the same on every rank).
        self._cached = {}  # (ps, name) -> (slot, request)
        self._slots = []  # slot -> ((ps, name), request)
        self.cache_capacity = int(env_float("HOROVOD_CACHE_CAPACITY", 1024))
        self._last_cycle = 0.0
        self._lock = threading.Lock()  # one cycle at a time
        self._cv = threading.Condition()  # the queue; wakes the background thread
        self._done = threading.Condition()  # wakes threads waiting for their ops
        self._waiting = 0
        self._stop = False
        self.broken = None  # the error that ended the controller; every later op raises it
        self._cause = None  # the plait exception behind it
        self._thread = threading.Thread(target=self._loop, name="plait-horovod", daemon=True)
        self._thread.start()

    # -- submission ----------------------------------------------------------------------------
    def submit(self, ops, notify=True):
        """Queues ops (a group is submitted at once, so it reaches every rank in one cycle)."""
        with self._cv:
            if self.broken is not None:  # e.g. an idle cycle already met a dead peer
                err = HorovodInternalError(str(self.broken))
                err.flight = getattr(self._cause, "flight", None)
                raise err from self._cause
            keys = {(o.req[2], o.req[1]) for o in ops}
            if len(keys) != len(ops):
                raise ValueError(f"rank {self.rank}: a group submits the same tensor name twice")
            for o in self._queue:
                if (o.req[2], o.req[1]) in keys:
                    raise ValueError(f"rank {self.rank}: tensor name {o.req[1]!r} is already in flight")
            for k in keys:
                if k in self._mine:
                    raise ValueError(f"rank {self.rank}: tensor name {k[1]!r} is already in flight")
            if self.timeline is not None:
                for o in ops:
                    self.timeline.negotiate_start(o.req[1], o.req[0])
            for o in ops:
                if o.device >= 0:  # the stream that made the tensor: the op runs after it
                    o.ready = _device.layer.ready(o.device)
            self._queue.extend(ops)
            if notify:
                self._cv.notify()

    def wait(self, ops, timeout=None):
        """Runs cycles on this thread (or lets the background one) until all ops are done."""
        end = None if timeout is None else time.monotonic() + timeout
        while not all(o.done for o in ops):
            if self.broken is not None and not self._thread.is_alive():
                self._fail_all(self.broken)
                break
            if self._lock.acquire(blocking=False):
                try:
                    if not all(o.done for o in ops) and self.broken is None and not self._stop:
                        self._cycle()
                except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
                    self._break(e)
                finally:
                    self._lock.release()
            else:
                with self._done:
                    self._waiting += 1
                    self._done.wait(0.0005)
                    self._waiting -= 1
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"rank {self.rank}: ops still running after {timeout} s")
        for o in ops:
            if o.gpu_done is not None:  # the op's GPU work: final on every stream once this returns
                _device.layer.synchronize(o.gpu_done)
                o.gpu_done = None
            if o.error is not None:
                err = HorovodInternalError(o.error)
                # plait's flight recorder report of the failed collective, when one failed
                err.flight = getattr(self._cause, "flight", None) if o.error == self.broken else None
                raise err from (self._cause if o.error == self.broken else None)

    def shutdown(self):
        """Tells every rank that this one is done (their pending ops fail), then stops."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=max(5.0, self.deadline_s))

    # -- the cycle -----------------------------------------------------------------------------
    def _loop(self):
        while True:
            with self._cv:
                if not self._queue and not self._stop:
                    self._cv.wait(self.cycle_s)
                    # Idle: a cycle another thread ran meanwhile, or is running (a waiter's long
                    # allreduce), serves the peers already; one more here would only meet a
                    # waiter's next cached cycle and make it fall back.
                    recent = time.monotonic() - self._last_cycle < self.cycle_s or self._lock.locked()
                    if not self._queue and not self._stop and (recent or self._idle_alone()):
                        continue
            with self._lock:
                if self.broken is not None:
                    return
                try:
                    if self._cycle():
                        return
                except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
                    self._break(e)
                    return

    def _idle_alone(self):
        return self.size == 1 and not self._mine and not self._table

    def _break(self, e):
        from plait import _errors

        if isinstance(e, _errors.PlaitError):
            what = (
                f"rank {self.rank}: a collective of the horovod coordinator failed: {type(e).__name__}: {e}"
            )
        else:
            what = f"rank {self.rank}: horovod coordinator failed: {type(e).__name__}: {e}"
        self._cause = e
        self.broken = what
        self._fail_all(what)

    def _fail_all(self, why):
        with self._cv:
            ops = list(self._mine.values()) + self._queue
            self._mine, self._queue = {}, []
            if self._join_op is not None:
                ops.append(self._join_op)
                self._join_op = None
            for o in ops:
                if not o.done:
                    o.error, o.done = why, True
        self._wake_waiters()

    def _cycle(self):
        """One negotiation and the ops it made ready. True once every rank is to stop."""
        with self._cv:
            new, self._queue = self._queue, []
            stop = self._stop
        fast = self._fast_plan(new) if len(new) == 1 and not stop else None
        if fast is not None:
            msgs = self._fast_cycle(new[0], *fast)
            if msgs is None:
                return False
        else:
            msg = self._message(new, stop)
            if self.timeline is not None:
                self.timeline.cycle_start()
            msgs = self._exchange(msg)
            self._last_cycle = time.monotonic()
            self._cycle_no += 1
        return self._settle(msgs)

    def _message(self, new, stop):
        msg = {"r": []}
        slots = []
        for o in new:
            if o.req[0] == _JOIN:
                self._join_op = o
                msg["r"].append(o.req)
                msg["join"] = 1
            else:
                key = (o.req[2], o.req[1])
                self._mine[key] = o
                hit = self._cached.get(key)
                if hit is not None and hit[1] == o.req:
                    slots.append(hit[0])
                else:
                    msg["r"].append(o.req)
        if slots:
            msg["c"] = slots
        if stop:
            msg["stop"] = 1
        if self.rank == 0:
            self._rank0_checks(msg)
        return msg

    def _settle(self, msgs):
        """The rest of a cycle once every rank's message is here: the table, the ready ops."""
        stopping = [r for r, m in enumerate(msgs) if m.get("stop")]
        for r, m in enumerate(msgs):
            for req in m["r"]:
                if req[0] == _JOIN:
                    continue
                key = (req[2], req[1])
                self._table.setdefault(key, {})[r] = req
                if self.rank == 0:
                    self._first_seen.setdefault(key, time.monotonic())
                if self.timeline is not None:
                    self.timeline.negotiate_rank(req[1], req[0], r)
            for slot in m.get("c", ()):
                key, req = self._slots[slot]
                self._table.setdefault(key, {})[r] = req
                if self.rank == 0:
                    self._first_seen.setdefault(key, time.monotonic())
                if self.timeline is not None:
                    self.timeline.negotiate_rank(req[1], req[0], r)
            if m.get("join"):
                self._joined[r] = self._cycle_no
        for key, missing, waited in msgs[0].get("expire", ()):
            self._expire(tuple(key), missing, waited)
        ready = self._ready()
        if ready:
            self.executor.run(self, ready)
        if len(self._joined) == self.size:
            self._finish_join()
        if stopping:
            who = ", ".join(map(str, stopping))
            self._fail_all(
                f"Horovod has been shut down: rank(s) {who} called shutdown() or exited; ops that "
                "the other ranks submitted after that cannot complete (rank "
                f"{self.rank})"
            )
            self.broken = self.broken or f"horovod is shut down (rank(s) {who} shut down)"
            return True
        return False

    def _buffers(self):
        if self._frame is None:  # kept: this runs under the cycle lock, one cycle at a time
            self._frame = np.zeros(_FRAME, dtype=np.uint8)
            self._frames = np.zeros((self.size, _FRAME), dtype=np.uint8)
            self._frame64, self._frame32 = self._frame.view(np.int64), self._frame.view(np.int32)
            self._frames64, self._frames32 = self._frames.view(np.int64), self._frames.view(np.int32)

    def _exchange(self, msg):
        """Every rank's message of this cycle, in rank order. A message of cached requests only
        (the steady state of a training loop, and idle cycles) travels as its slot numbers, a
        negative length saying how many; any other as JSON."""
        if self.size == 1:
            return [msg]
        self._buffers()
        frame = self._frame
        slots = msg.get("c", ())
        if not msg["r"] and len(msg) <= 1 + bool(slots) and len(slots) <= _MAX_SLOTS:
            blob = b""
            self._frame64[0] = -1 - len(slots)
            if slots:
                self._frame32[2 : 2 + len(slots)] = slots
        else:
            blob = json.dumps(msg, separators=(",", ":")).encode()
            head = min(len(blob), _FRAME - 8)
            frame[:8].view(np.int64)[0] = len(blob)
            frame[8 : 8 + head] = np.frombuffer(blob, dtype=np.uint8, count=head)
        self.comm.allgather(frame, self._frames)
        return self._unpack(blob)

    def _unpack(self, blob):
        """The messages in the frames the cycle's allgather filled (blob: this rank's JSON, when
        it sent one; a message longer than a frame sends its tail in a second allgather)."""
        frames = self._frames
        lengths = self._frames64[:, 0].tolist()
        longest = max(lengths)
        tails = None
        if longest > _FRAME - 8:
            tail = np.zeros(longest - (_FRAME - 8), dtype=np.uint8)
            rest = blob[_FRAME - 8 :]
            tail[: len(rest)] = np.frombuffer(rest, dtype=np.uint8) if rest else tail[:0]
            tails = self.comm.allgather(tail)
        out = []
        for r, f in enumerate(frames):
            n = lengths[r]
            if n < 0:
                out.append({"r": (), "c": self._frames32[r, 2 : 1 - n].tolist()})
                continue
            data = f[8 : 8 + min(n, _FRAME - 8)].tobytes()
            if n > _FRAME - 8:
                data += tails[r][: n - (_FRAME - 8)].tobytes()
            out.append(json.loads(data))
        return out

    def members(self, ps_id):
        ps = self.process_sets.get(ps_id)
        return ps.ranks if ps is not None else None

    def _ready(self):
        ready = []
        for key, reqs in list(self._table.items()):
            ranks = self.members(key[0])
            if ranks is None:
                continue
            if all(r in reqs or r in self._joined for r in ranks):
                del self._table[key]
                self._first_seen.pop(key, None)
                self._warned.discard(key)
                ready.append((key, reqs))
        return ready

    def _finish_join(self):
        last_cycle = max(self._joined.values())
        last = max(r for r, c in self._joined.items() if c == last_cycle)
        self._joined = {}
        op, self._join_op = self._join_op, None
        if op is not None:
            op.result, op.done = last, True
        self._wake_waiters()

    def remember(self, key, reqs):
        """Caches a name that every rank submitted alike and that passed its check (run on every
        rank for the same names in the same order, so the slots agree)."""
        vals = iter(reqs.values())
        q0 = next(vals)
        if q0[0] in _UNCACHED or ".noname." in key[1] or any(v is not q0 and v != q0 for v in vals):
            return
        hit = self._cached.get(key)
        if hit is not None:
            if hit[1] is not q0:
                self._cached[key] = (hit[0], q0)
                self._slots[hit[0]] = (key, q0)
        elif len(self._slots) < self.cache_capacity:
            self._cached[key] = (len(self._slots), q0)
            self._slots.append((key, q0))

    def complete(self, key, error=None, result=None):
        op = self._mine.pop(key, None)
        if op is None:
            return
        if error is None and op.finish is not None:
            try:
                result = op.finish(op, result)
            except Exception as e:  # noqa: BLE001 - it belongs to the waiter
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
        if error is None and op.device >= 0:
            op.gpu_done = _device.layer.done(op.device)  # after the op's copies out, on its stream
        op.result, op.error = result, error
        op.done = True
        if self.timeline is not None:
            self.timeline.op_end(key[1])
        self._wake_waiters()

    def _wake_waiters(self):
        # Only threads blocked while another one runs the cycle wait here; waking no one (the
        # common case: the waiter runs the cycle itself) costs no thread switch.
        if self._waiting:
            with self._done:
                self._done.notify_all()

    # -- rank 0's clock ------------------------------------------------------------------------
    def _missing(self, key):
        reqs = self._table.get(key, {})
        ranks = self.members(key[0]) or []
        return [r for r in ranks if r not in reqs and r not in self._joined]

    def _rank0_checks(self, msg):
        now = time.monotonic()
        expire, stalled = [], []
        for key, t0 in list(self._first_seen.items()):
            if key not in self._table:
                continue
            waited = now - t0
            if waited > self.deadline_s:
                expire.append([list(key), self._missing(key), round(waited, 1)])
            elif self.stall_check and waited > self.stall_s and key not in self._warned:
                self._warned.add(key)
                stalled.append(key)
        if expire:
            msg["expire"] = expire
        if stalled:
            by_rank = {}
            for key in stalled:
                for r in self._missing(key):
                    by_rank.setdefault(r, []).append(key[1])
            lines = "\n".join(f"{r}: [{', '.join(names)}]" for r, names in sorted(by_rank.items()))
            print(
                f"[plait.horovod] WARNING: stall: {len(stalled)} tensor(s) were submitted by some "
                f"ranks and have waited more than {self.stall_s:g} s for the others (ranks that "
                "submit different tensors, or only some ranks submitting, deadlock). "
                f"Missing ranks:\n{lines}",
                file=sys.stderr,
                flush=True,
            )

    def _expire(self, key, missing, waited):
        reqs = self._table.pop(key, None)
        self._first_seen.pop(key, None)
        if reqs is None:
            return
        kind = next(iter(reqs.values()))[0]
        self.complete(
            key,
            error=(
                f"rank {self.rank}: {kind} of tensor {key[1]!r} (process set {key[0]}) was not submitted "
                f"by rank(s) {missing} within {waited:g} s (deadline {self.deadline_s:g} s: "
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, else PLAIT_TIMEOUT); submitted by rank(s) "
                f"{sorted(reqs)}"
            ),
        )
