"""Rendezvous waits that stop as soon as the rendezvous cannot complete.

A rank waiting in the store for a peer's key otherwise learns nothing until its deadline: not that
the peer died after announcing itself, nor that it failed (a bad setting, no /dev/shm space) and
will never write the key. Here each rank announces who it is (machine, pid namespace, pid, start
time) and a failing rank publishes why under `<prefix>/error`; waits go in short slices, and
between slices look at that key and at the announced peers this process can see (same machine and
pid namespace: /proc tells whether they still run). A dead peer or a published failure raises at
once on every waiting rank.
"""

import json
import os
import socket
import time

from . import _errors, _shm

# How often a waiting rank looks for a failure or a dead peer: the time to notice one.
SLICE_S = 0.1


def identity():
    """This process as peers on the same machine can check it: 'machine pidns pid starttime'."""
    return f"{_machine()} {_pidns()} {os.getpid()} {_start_time(os.getpid())}"


def _machine():
    from . import _hosts

    return _hosts.machine_id().replace(" ", "_")


def _pidns():
    try:
        return os.readlink("/proc/self/ns/pid").replace(" ", "_")
    except OSError:
        return "?"


def _start_time(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
    except OSError:
        return "?"
    fields = line[line.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else "?"


def parse_identity(text, who):
    """(machine, pidns, pid, start time) of an announcement; InvalidArgument when it is not one."""
    parts = text.split(" ")
    if len(parts) != 4 or not parts[2].isdigit() or not 0 < int(parts[2]) < 1 << 31:
        raise _errors.InvalidArgument(f"{who} announced {text[:80]!r}, not a plait process identity")
    return parts[0], parts[1], int(parts[2]), parts[3]


def local_pid(ident):
    """The pid of an identity this process can check (same machine and pid namespace), else 0."""
    machine, pidns, pid, _ = ident
    return pid if machine == _machine() and pidns == _pidns() else 0


def gone(ident):
    """Whether the process of an identity has died (False when it cannot be told from here)."""
    pid = local_pid(ident)
    if not pid:
        return False
    if _shm._dead(pid):
        return True
    started = _start_time(pid)
    return ident[3] != "?" and started not in ("?", ident[3])  # the pid now names another process


def _check(client, key):
    check = getattr(client, "check", None)
    if check is None:
        return None  # a duck-typed store without check(): failures surface at its deadline
    return check([key])


def failure_key(prefix):
    return f"{prefix}/error"


def publish(client, prefix, rank, exc):
    """Tells the other ranks of the rendezvous why this one will not complete it (best effort)."""
    if getattr(exc, "_plait_published", False) or not isinstance(exc, Exception):
        return
    record = {"rank": rank, "kind": type(exc).__name__, "error": str(exc)}
    try:
        client.set(failure_key(prefix), json.dumps(record).encode())
    except Exception:  # noqa: BLE001 - the store itself may be what failed
        pass


def published(client, prefix, rank):
    """The error a peer published under prefix, as the exception this rank raises; else None."""
    try:
        if not _check(client, failure_key(prefix)):
            return None
        record = json.loads(client.get(failure_key(prefix), timeout=1.0))
    except Exception:  # noqa: BLE001 - no verdict: the caller keeps its own error
        return None
    if not isinstance(record, dict):
        return None
    cls = getattr(_errors, str(record.get("kind")), None)
    if not (isinstance(cls, type) and issubclass(cls, _errors.PlaitError)):
        cls = _errors.PlaitError
    who = record.get("rank")
    err = cls(f"rank {rank}: rank {who} failed while joining the communicator: {record.get('error')}")
    err._plait_published = True
    return err


class Watch:
    """Waits for keys of one rendezvous, watching its failure key and the peers it was told of."""

    def __init__(self, client, prefix, rank, size, timeout):
        self.client, self.prefix, self.rank, self.size = client, prefix, rank, size
        self.timeout = timeout
        self.peers = {}  # rank -> identity tuple, for the ranks this process can watch
        self._follow = {}  # rank -> the key where it announces itself, until it has
        self.sliced = _check(client, failure_key(prefix)) is not None

    def know(self, r, ident):
        self._follow.pop(r, None)
        if r != self.rank and local_pid(ident):
            self.peers[r] = ident

    def follow(self, r, key, parse):
        """Watch rank r from when `key` (its announcement, read by parse) appears."""
        self._follow[r] = (key, parse)

    def pids(self):
        """Each rank's pid where this process can watch it, else 0 (for the native init)."""
        return [self.peers[r][2] if r in self.peers else 0 for r in range(self.size)]

    def raise_if_failed(self):
        err = published(self.client, self.prefix, self.rank)
        if err is not None:
            raise err
        for r, (key, parse) in list(self._follow.items()):
            if self.client.check([key]):
                self.know(r, parse(self.client.get(key, timeout=0)))
        for r, ident in self.peers.items():
            if gone(ident):
                err = _errors.PeerLostError(
                    f"rank {self.rank}: rank {r} (pid {ident[2]} on {socket.gethostname()}) died "
                    f"while the {self.size}-rank communicator was being set up"
                )
                publish(self.client, self.prefix, self.rank, err)
                err._plait_published = True
                raise err

    def get(self, key, timeout=None):
        """The value of key, waiting up to timeout (default: the watch's)."""
        timeout = self.timeout if timeout is None else timeout
        if not self.sliced:
            return self.client.get(key, timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            step = SLICE_S if left is None else min(SLICE_S, left)
            try:
                if step <= 0:  # a zero wait is "the store's default" to some stores: look instead
                    if not self.client.check([key]):
                        raise _errors.TimeoutError(key)
                else:
                    self.client.wait([key], timeout=step)
                return self.client.get(key, timeout=0)
            except _errors.TimeoutError:
                self.raise_if_failed()
                if left is not None and left <= step:
                    raise _errors.TimeoutError(
                        f"rank {self.rank}: timed out after {timeout:g} s waiting for {key!r} "
                        f"in the rendezvous of a {self.size}-rank communicator"
                    ) from None
