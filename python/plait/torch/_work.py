"""Works, futures and the completion thread of a process group.

A torch call becomes one _Op: the plait handles it issued (in order), the steps to run once
they are done (copy a temporary back into a non-contiguous output, divide for an integer AVG,
...), and the value its Future carries (the output tensors, as gloo's do).

The Future must complete when the collective does even if nobody calls wait(): DDP's reducer
only ever waits on get_future(). So each group has one completion thread that waits on the ops
in issue order (blocked in C++ with the GIL released) and completes them; the futures'
callbacks run on it. A callback that issues a collective gets it completed before the call
returns (the callback may then wait on its future: nobody else would complete it). A callback
must not block on the future of an op issued elsewhere that is still running: that op's
completion waits behind the callback.

Work.wait() does not queue behind that thread: it waits on the plait handles itself and
completes the op if it gets there first, which saves a thread hop on every waited call. A
synchronous call (opts.asyncOp False, i.e. dist.* without async_op) runs inline and its op is
complete before its Work exists.

CUDA ops (all handles on the GPU) follow torch's NCCL semantics instead: they complete in
stream order as soon as they are issued, on the issuing thread. Waiting is making a stream wait
for the call's event (cudaStreamWaitEvent), never the host; the Future is CUDA-aware
(torch.futures.Future(devices=...)), so its callbacks and waiters are ordered after the collective
on their own streams. The GPU communicator's watchdog enforces the deadline and aborts on a dead
or missing peer; its error is raised by the next call (or Work.wait()).
"""

import queue
import threading
import time

import torch
import torch.distributed as dist

from . import _errors

_PENDING, _OK, _FAILED = 0, 1, 2


def _on_gpu(h):
    return hasattr(h, "block")  # a plait GPU handle (plait._gpu.GpuHandle)


def _new_future(devices):
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def _block_current(handles):
    """Makes each handle's device's current stream wait for its call; the host goes on."""
    for h in handles:
        h.block(torch.cuda.current_stream(h.device).cuda_stream)


class _Op:
    handles = after = gpu = ()
    _devices = None  # CUDA ops: the devices of their CUDA-aware Future
    _fut = None
    _error = None
    _lock = None

    def __init__(self, where, value):
        self.handles = []
        self.after = []
        self.value = value
        self.where = where
        self._state = _PENDING
        self._lock = threading.Lock()

    @property
    def fut(self):
        if self._fut is None:
            with self._lock or threading.Lock():  # no lock: completed at birth, nothing races
                if self._fut is None:
                    # The Future users see is a then() of a private trigger, and an error is
                    # raised inside that callback: torch 2.13's DDP reducer segfaults on a Python
                    # Future failed with set_exception(), but reports a callback's error cleanly.
                    trigger = _new_future(self._devices)
                    self._fut = (trigger, trigger.then(self._outcome))
                    if self._state != _PENDING:
                        trigger.set_result(self._trigger_value())
        return self._fut[1]

    def cuda(self):
        """All of this op's plait calls run on the GPU (its completion is stream-ordered)."""
        return bool(self.handles) and all(_on_gpu(h) for h in self.handles)

    def _trigger_value(self):
        # A CUDA-aware Future records an event on the current stream of each tensor's device
        # when it completes: completing it with the outputs, right after the collective was
        # issued on that stream, orders its callbacks and waiters after the collective.
        return self.value if self._devices and self._state == _OK else None

    def _outcome(self, _):
        if self._state == _FAILED:
            raise self._error
        return self.value

    def finish(self):
        """Completes the op once its handles are done; exactly once, whichever thread calls first."""
        with self._lock:
            if self._state != _PENDING:
                return
            cuda = self.cuda()
            try:
                if cuda:
                    self.gpu = tuple(self.handles)
                    self._devices = sorted({torch.device("cuda", h.device) for h in self.gpu}, key=str)
                    _block_current(self.gpu)
                else:
                    for h in self.handles:
                        h.wait()
                for step in self.after:
                    step()
                self._state = _OK
            except BaseException as e:  # noqa: BLE001 - it belongs to the Work
                self._error = _errors.to_torch(e, self.where)
                self._state = _FAILED
            self.handles, self.after = (), ()
            fut = self._fut
        if cuda and fut is None:
            self.fut  # noqa: B018 - created and completed now, in stream order on this thread
        elif fut is not None:  # outside the lock: set_result runs the future's callbacks
            fut[0].set_result(self._trigger_value())

    def wait_handles(self, timeout_s=None):
        """Waits for the plait calls (not for finish()); False when timeout_s passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for h in self.handles:
            if deadline is None:
                try:
                    h.wait()
                except Exception:  # noqa: BLE001 - finish() reports it
                    return True
                continue
            try:
                h.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - the call failed (finish() reports it) or is still running
                if not h.done():
                    return False
                return True
        return True


def completed(where, value):
    """An op that finished before its Work was made (a synchronous call)."""
    op = _Op.__new__(_Op)
    op.where, op.value, op._state = where, value, _OK
    return op


class Work(dist.Work):
    """A c10d Work over an _Op; what every collective of the plait group returns."""

    def __init__(self, op):
        super().__init__()
        self._op = op

    def wait(self, timeout=None):
        op = self._op
        if op.gpu and op._state == _OK:
            # torch's NCCL semantics: the current stream waits for the collective, the host not.
            try:
                _block_current(op.gpu)
            except Exception as e:  # noqa: BLE001 - an error the watchdog recorded since
                raise _errors.to_torch(e, op.where) from None
            return True
        if op._state == _PENDING:
            secs = None if timeout is None else timeout.total_seconds()
            if not op.wait_handles(secs if secs and secs > 0 else None):
                raise _errors.PlaitTimeoutError(
                    f"{op.where}: Work.wait timed out after {secs:g} s (the call goes on)"
                )
            op.finish()
            fut = op._fut[1] if op._fut is not None else None
            if fut is not None and not fut.done():  # the completion thread is setting it now
                try:
                    fut.wait()
                except Exception:  # noqa: BLE001 - raised below as the op's error
                    pass
        if op._state == _FAILED:
            raise op._error
        return True

    def is_completed(self):
        return self._op._state != _PENDING

    def is_success(self):
        return self._op._state == _OK

    def exception(self):
        return self._op._error

    def get_future(self):
        return self._op.fut

    def result(self):
        self.wait()
        return self._op.value

    def synchronize(self):
        if self._op.gpu and self._op._state == _OK:
            _block_current(self._op.gpu)


class Completer:
    """The completion thread of one group: finishes ops in issue order. Started on first use."""

    def __init__(self, name):
        self._name = name
        self._q = queue.SimpleQueue()
        self._thread = None
        self._ident = None
        self._mu = threading.Lock()

    def submit(self, op):
        if threading.get_ident() == self._ident:
            # Issued by a Future callback running on this very thread (PowerSGD's hook issues
            # an all-reduce and waits on its future there): nobody else would complete it, so
            # finish it now, before the callback can block on it.
            op.wait_handles()
            op.finish()
            return
        if self._thread is None:
            with self._mu:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self._thread.start()
        self._q.put(op)

    def _loop(self):
        self._ident = threading.get_ident()
        while True:
            op = self._q.get()
            if op is None:
                return
            op.wait_handles()
            op.finish()

    def close(self, timeout_s=None):
        """Stops the thread after the ops already submitted; True if it ended in time."""
        with self._mu:
            thread, self._thread = self._thread, None
            self._ident = None
        if thread is None:
            return True
        self._q.put(None)
        thread.join(timeout_s)
        return not thread.is_alive()
