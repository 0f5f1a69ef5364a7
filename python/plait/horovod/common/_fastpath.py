"""The coordinator's cached fast path (a mixin of common/_controller.py's Controller).

A training loop submits the same cached requests every step. When a cached allreduce (one tensor,
or one CPU group of one dtype) has run alone in a cycle, the executor hands the controller its
plan (which buffer, plait op and scale factors: a native _HvdPlan). The next cycle whose only
request is that one, with nothing else pending here (no name waiting for other ranks, no join, no
timeline), runs whole in one native call (csrc/torch/horovod_fast.cc): the cycle's usual allgather
of 1 KiB frames and, when every rank's frame is the same slot, the plan. The ready list, checks
and fusion are then exactly the Python cycle's: that one name, checked when it was cached, alone
in its fusion group. Any other frame from any rank and the cycle goes on in Python from the
exchange (_settle), so peers may run either path, and the Python path alone (no native module, or
PLAIT_HOROVOD_NATIVE=0) gives the same results.
"""

import json
import time


class FastPath:
    def run(self, ops):
        """submit(ops) then wait(ops), for a synchronous call: a cached allreduce with a kept plan
        runs its cycle at once, on this thread, when no other cycle is running."""
        if len(ops) == 1 and self.fast is not None and not self._queue and self._lock.acquire(blocking=False):
            try:
                taken = self._run_fast(ops[0])
            finally:
                self._lock.release()
            if taken:
                self.wait(ops)  # done, or in the table after a cycle that fell back
                return
        self.submit(ops, notify=False)
        self.wait(ops)

    def _run_fast(self, o):
        """Under the cycle lock: runs a cycle with o alone if it has a kept plan; True if it did."""
        if self.broken is not None or self._stop or self._queue or (o.req[2], o.req[1]) in self._mine:
            return False  # submit() raises, or the queued ops go first
        fast = self._fast_plan([o])
        if fast is None:
            return False
        try:
            msgs = self._fast_cycle(o, *fast)
            if msgs is not None:
                self._settle(msgs)
        except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
            self._break(e)
        return True

    def _fast_plan(self, new):
        """(slot, plan) when this cycle's one op is a cached allreduce with a kept plan and
        nothing else can happen in it here (no name waiting in the table, no join, no timeline):
        if every rank's frame is then the same slot, the ready list is that name alone, and its
        check, fusion and plait calls are the plan's. Else None."""
        o = new[0]
        if self.fast is None or self._table or self._joined or self._join_op is not None:
            return None
        key = (o.req[2], o.req[1])
        kept = self._plans.get(key)
        if kept is None or kept[1] is not o.layout or self.timeline is not None:
            return None
        hit = self._cached.get(key)
        if hit is None or hit[1] is not kept[2] or hit[1] != o.req:
            return None
        return hit[0], kept[0]

    def _fast_cycle(self, o, slot, plan):
        """Runs the cycle in one native call; None if the plan ran, else every rank's message
        (another rank sent something else: the cycle goes on as the Python one would)."""
        key = (o.req[2], o.req[1])
        self._mine[key] = o
        st = self.fast.run(slot, plan, o.output)
        self._last_cycle = time.monotonic()
        self._cycle_no += 1
        if st == 0:
            self.executor.calls += 1
            self.fast_cycles += 1
            self.complete(key)
            return None
        if st > 0:
            raise self._plait_error(st, self.fast.error)
        return self._unpack(b"")

    def keep_plan(self, key, layout, make):
        """Keeps the plan make() builds for a cached name just run alone on this rank's CPU: valid
        while the name's cached request (the same object: a changed one is a new object) and its
        group layout stay."""
        hit = self._cached.get(key)
        if hit is None or self.fast is None or self.planned(key, layout):
            return
        if len(self._plans) >= self.cache_capacity:
            self._plans.clear()
        self._plans[key] = (make(), layout, hit[1])

    def planned(self, key, layout):
        kept, hit = self._plans.get(key), self._cached.get(key)
        return kept is not None and hit is not None and kept[1] is layout and kept[2] is hit[1]

    def fast_path(self, nat):
        """Turns the cached fast path on with plait's native torch module nat (the executor's
        call, when it has one): needs a native communicator and the exchange's buffers."""
        if self.fast is not None or self.size == 1:
            return self.fast is not None
        from plait import _C

        native = getattr(self.comm, "_c", None)
        if not isinstance(native, _C._Comm):
            return False
        self._buffers()
        self.fast = nat._HvdCycle(_C._capi, _C._comm_capsule(native), self.comm, self._frame, self._frames)
        return True

    def _plait_error(self, kind, text):
        from plait import _errors

        cls = {2: _errors.InvalidArgument, 3: _errors.MismatchError, 4: _errors.TimeoutError}
        cls[5] = _errors.PeerLostError
        e = cls.get(kind, _errors.PlaitError)(text)
        if kind in (3, 4, 5):  # the flight recorder's report, as plait's own calls attach it
            try:
                e.flight = json.loads(self.comm._c.flight_json())
            except Exception:  # noqa: BLE001 - the error itself is what matters
                e.flight = None
        return e
