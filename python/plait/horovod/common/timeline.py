"""Horovod's timeline (HOROVOD_TIMELINE=file, hvd.start_timeline): a Chrome trace of each tensor's
life on rank 0. Every tensor is one trace "process" named after it, holding NEGOTIATE_<OP> (from
this rank's submission until every rank has submitted it, with an instant tick per rank as its
request arrives), then <OP> with nested activities (MEMCPY_IN_FUSION_BUFFER, PLAIT_ALLREDUCE,
MEMCPY_OUT_FUSION_BUFFER). mark_cycles adds a CYCLE_START instant per coordinator cycle.

The file is valid JSON whenever it is read: events are written after each cycle, followed by the
closing bracket, which the next write overwrites (chrome://tracing and Perfetto load it)."""

import json
import threading
import time


class Timeline:
    def __init__(self, path, mark_cycles=False):
        self.path = path
        self.mark_cycles = mark_cycles
        self._f = open(path, "w")
        self._f.write("[\n")
        self._end = self._f.tell()
        self._f.write("]\n")
        self._f.flush()
        self._first = True
        self._pending = []
        self._pids = {}
        self._open = {}  # name -> names of the open B events, innermost last
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def _ts(self):
        return int((time.monotonic() - self._t0) * 1e6)

    def _pid(self, name):
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._pending.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            self._pending.append(
                {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
            )
        return pid

    def _begin(self, name, what):
        self._pending.append({"name": what, "ph": "B", "ts": self._ts(), "pid": self._pid(name), "tid": 0})
        self._open.setdefault(name, []).append(what)

    def _end_one(self, name):
        stack = self._open.get(name)
        if stack:
            stack.pop()
            self._pending.append({"ph": "E", "ts": self._ts(), "pid": self._pid(name), "tid": 0})

    def negotiate_start(self, name, kind):
        with self._lock:
            if name not in self._open or not self._open[name]:
                self._begin(name, "NEGOTIATE_" + kind.upper())

    def negotiate_rank(self, name, kind, rank):
        with self._lock:
            if not self._open.get(name):
                self._begin(name, "NEGOTIATE_" + kind.upper())
            self._pending.append(
                {"name": str(rank), "ph": "i", "s": "p", "ts": self._ts(), "pid": self._pid(name), "tid": 0}
            )

    def op_start(self, name, op):
        with self._lock:
            while self._open.get(name):
                self._end_one(name)
            self._begin(name, op)

    def activity(self, name, what):
        with self._lock:
            if len(self._open.get(name, ())) > 1:
                self._end_one(name)
            self._begin(name, what)

    def op_end(self, name):
        with self._lock:
            while self._open.get(name):
                self._end_one(name)
            self._open.pop(name, None)
        self.flush()

    def cycle_start(self):
        with self._lock:
            if self.mark_cycles:
                self._pending.append(
                    {"name": "CYCLE_START", "ph": "i", "s": "g", "ts": self._ts(), "pid": 0, "tid": 0}
                )
        self.flush()

    def flush(self):
        with self._lock:
            if not self._pending or self._f is None:
                return
            text = "".join(
                ("" if self._first and i == 0 else ",\n") + json.dumps(e, separators=(",", ":"))
                for i, e in enumerate(self._pending)
            )
            self._first = False
            self._pending = []
            self._f.seek(self._end)
            self._f.write(text)
            self._end = self._f.tell()
            self._f.write("\n]\n")
            self._f.truncate()
            self._f.flush()

    def close(self):
        self.flush()
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None
