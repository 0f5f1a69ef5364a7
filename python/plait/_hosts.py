"""Which ranks share a host: identities exchanged at rendezvous, and the layout derived from them."""

import json
import os
import socket

import numpy as np

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def machine_id():
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def host_id():
    """This process's host identity: PLAIT_HOST_ID (tests simulate hosts with it), else the machine."""
    return os.environ.get("PLAIT_HOST_ID") or machine_id()


class Layout:
    """Which global ranks share a host. hosts[h] = global ranks of host h in order."""

    def __init__(self, ids, rank):
        order = []
        for hid in ids:
            if hid not in order:
                order.append(hid)
        self.hosts = [[r for r, x in enumerate(ids) if x == hid] for hid in order]
        self.host_of = [order.index(x) for x in ids]
        self.local_of = [self.hosts[self.host_of[r]].index(r) for r in range(len(ids))]
        self.h, self.i = self.host_of[rank], self.local_of[rank]
        self.uniform = len({len(m) for m in self.hosts}) == 1
        L, H = len(self.hosts[0]), len(self.hosts)
        # perm[i * H + h] = global rank of local rank i on host h (uniform layout only)
        self.perm = (
            np.array([self.hosts[h][i] for i in range(L) for h in range(H)], dtype=np.int64)
            if self.uniform
            else None
        )
        # hosts interleaved in rank order (rank = i * H + h): the (local rank, host) order of the
        # hierarchical steps is global order, and no reordering copy is needed
        self.in_order = self.uniform and bool((self.perm == np.arange(L * H)).all())

    @property
    def nhosts(self):
        return len(self.hosts)

    def describe(self):
        return "; ".join(f"host {h}: ranks {m}" for h, m in enumerate(self.hosts))


def exchange(client, prefix, rank, size, timeout, watch=None):
    """Every rank's (host id, machine id), through the store: rank 0 gathers the table and
    publishes it under one key, so the store serves O(size) requests, not O(size^2). Each record
    also names its process (plait._watch.identity), which `watch` then keeps an eye on."""
    from . import _errors, _watch

    get = watch.get if watch is not None else (lambda k, t: client.get(k, timeout=t))
    mine = f"{host_id()}\n{machine_id()}\n{_watch.identity()}"
    client.set(f"{prefix}/host/{rank}", mine.encode())
    if rank != 0:
        if watch is not None:
            watch.follow(0, f"{prefix}/host/0", lambda v: _parse(v, 0)[2])
        table = json.loads(get(f"{prefix}/hosts", timeout))
        if not isinstance(table, list) or len(table) != size or not all(isinstance(v, str) for v in table):
            raise _errors.InvalidArgument(
                f"rank {rank}: the host table under {prefix!r} is not {size} records"
            )
    else:
        table = [mine]
        for r in range(1, size):
            table.append(get(f"{prefix}/host/{r}", timeout).decode(errors="replace"))
            if watch is not None:
                watch.know(r, _parse(table[-1], r)[2])
        client.set(f"{prefix}/hosts", json.dumps(table).encode())
    parsed = [_parse(v, r) for r, v in enumerate(table)]
    if watch is not None:
        for r, (_, _, ident) in enumerate(parsed):
            watch.know(r, ident)
    return [(h, m) for h, m, _ in parsed]


def _parse(record, r):
    """(host id, machine id, identity) of rank r's record; InvalidArgument naming r if malformed."""
    from . import _errors, _watch

    if isinstance(record, bytes):
        record = record.decode(errors="replace")
    parts = record.split("\n")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise _errors.InvalidArgument(
            f"rank {r}'s record in the rendezvous is {record[:80]!r}, not what a plait rank announces "
            "(another program, or another plait version, wrote it)"
        )
    return parts[0], parts[1], _watch.parse_identity(parts[2], f"rank {r}")
