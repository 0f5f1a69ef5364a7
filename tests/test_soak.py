"""Soak: a seeded random sequence of collectives, every result checked bit for bit.

Every rank draws the same sequence from one seed: communicator (the world, or one of its splits),
collective, dtype, op, size (0 B to several 4 KiB chunks), algorithm, in place or not, sync or
async; async handles pile up and are waited in a shuffled order. Inputs come from the closed
formula of test_collectives (integer-valued), so references are exact. A rank counts wrong
results and goes on, so the ranks stay in step; the parent requires 0 wrong.

CI runs >= 10,000 collectives over 2, 3, 4 and 8 ranks (8 on this 2-core machine: the
oversubscribed case, whose time is printed). PLAIT_SOAK_LONG=1 runs 20x longer with more seeds;
PLAIT_SOAK_SEED=<seed> replays a failure.
"""

import os
import random
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks
from test_collectives import FLOATS, OPS, data, dtype_kw, reduce_ref, storage

pytestmark = pytest.mark.slow  # minutes of multi-process runs: full suite only

LONG = os.environ.get("PLAIT_SOAK_LONG", "") not in ("", "0")
SEED = int(os.environ.get("PLAIT_SOAK_SEED", "1066"))
BUFFER = 8192  # 4 KiB per call: anything above that is multi-chunk
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
COLLS = (
    "allreduce",
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "alltoall",
    "sendrecv",
    "barrier",
)
ALGOS = {
    c: ("auto",) + tuple(plait.algorithms(c))
    for c in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall")
}
MAX_PENDING = 6
# (world size, collectives in CI): 11,000 in all.
RUNS = ((2, 3000), (3, 2000), (4, 2000), (5, 1000), (8, 3000))


def make_comms(world, rank, n):
    """The communicators every step picks from; the same names on every rank (None: not a member)."""
    comms = {
        "world": world,
        "halves": world.split(rank % 2),
        "reversed": world.split(0, key=n - rank),
        "big": world.split(0, buffer_bytes=64 << 10),
    }
    comms["all_but_last"] = world.split(None if rank == n - 1 else 0) if n > 2 else None
    comms["pairs"] = world.split(rank // 2) if n > 3 else None
    return comms


def draw(rng, i):
    """Step i of the sequence; every rank draws the same values."""
    coll = rng.choice(COLLS)
    dt = rng.choice(DTYPES)
    op = rng.choice(OPS if dt in FLOATS else OPS[:4])
    nbytes = rng.choice((0, rng.randrange(1, 64), rng.randrange(64, 4096), rng.randrange(4096, 20000)))
    return {
        "i": i,
        "coll": coll,
        "dt": dt,
        "op": op,
        "count": nbytes // storage(dt).itemsize,
        "algo": rng.choice(ALGOS.get(coll, ("auto",))),
        "inplace": rng.random() < 0.3,
        "async": rng.random() < 0.35,
        "comm": rng.choice(COMM_NAMES),
        "shift": rng.randrange(1, 8),
        "root": rng.randrange(8),
    }


COMM_NAMES = ("world", "world", "halves", "reversed", "big", "all_but_last", "pairs")


def start(comm, s):
    """Issues step s on comm; returns (handle or None, check() -> None or a description)."""
    r, m, c, dt, op, salt = comm.rank, comm.size, s["count"], s["dt"], s["op"], s["i"]
    kw = dict(dtype_kw(dt), async_op=s["async"])
    st = storage(dt)
    coll = s["coll"]

    def eq(got, want):
        got, want = np.ascontiguousarray(got), np.ascontiguousarray(want, dtype=st)
        if got.shape != want.shape or got.tobytes() != want.tobytes():
            bad = np.flatnonzero(got.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8))
            return "byte %s of %d differs" % (bad[:3], got.nbytes)
        return None

    if coll == "allreduce":
        x = data(r, c, dt, op, salt)
        out = x if s["inplace"] else np.empty_like(x)
        h = comm.allreduce(x, out=out, op=op, algorithm=s["algo"], **kw)
        return h, lambda: eq(out, reduce_ref([data(q, c, dt, op, salt) for q in range(m)], dt, op))
    if coll == "reduce_scatter":
        x = data(r, m * c, dt, op, salt)
        out = x[r * c : (r + 1) * c] if s["inplace"] else np.empty(c, st)
        h = comm.reduce_scatter(x, out=out, op=op, algorithm=s["algo"], **kw)
        return h, lambda: eq(
            out, reduce_ref([data(q, m * c, dt, op, salt)[r * c : (r + 1) * c] for q in range(m)], dt, op)
        )
    if coll == "allgather":
        out = np.zeros(m * c, st)
        x = out[r * c : (r + 1) * c] if s["inplace"] else np.empty(c, st)
        x[...] = data(r, c, dt, op, salt)
        h = comm.allgather(x, out=out, algorithm=s["algo"], **kw)
        return h, lambda: eq(out, np.concatenate([data(q, c, dt, op, salt) for q in range(m)]))
    if coll == "broadcast":
        root = s["root"] % m
        x = data(r, c, dt, op, salt) if r == root else np.zeros(c, st)
        out = None if s["inplace"] else np.zeros(c, st)
        h = comm.broadcast(x, root=root, out=out, algorithm=s["algo"], **kw)
        return h, lambda: eq(x if out is None else out, data(root, c, dt, op, salt))
    if coll == "reduce":
        root = s["root"] % m
        x = data(r, c, dt, op, salt)
        out = (x if s["inplace"] else np.empty_like(x)) if r == root else None
        h = comm.reduce(x, root=root, out=out, op=op, algorithm=s["algo"], **kw)
        if r != root:
            return h, lambda: None
        return h, lambda: eq(out, reduce_ref([data(q, c, dt, op, salt) for q in range(m)], dt, op))
    if coll == "alltoall":
        x = data(r, m * c, dt, op, salt)
        out = x if s["inplace"] else np.empty_like(x)
        h = comm.alltoall(x, out=out, algorithm=s["algo"], **kw)
        return h, lambda: eq(
            out, np.concatenate([data(q, m * c, dt, op, salt)[r * c : (r + 1) * c] for q in range(m)])
        )
    if coll == "sendrecv":
        if m == 1:
            return None, lambda: None
        k = s["shift"] % (m - 1) + 1
        x = data(r, c, dt, op, salt)
        out = np.zeros(c, st)
        hs = [
            comm.send(x, (r + k) % m, tag=salt, async_op=True, **dtype_kw(dt)),
            comm.recv(out, (r - k) % m, tag=salt, async_op=True, **dtype_kw(dt)),
        ]
        if not s["async"]:
            for h in hs:
                h.wait()
            hs = None
        return hs, lambda: eq(out, data((r - k) % m, c, dt, op, salt))
    h = comm.barrier(async_op=s["async"])
    return h, lambda: None


def _soak(rank, n, store, seed, steps):
    world = plait.init(
        rank, n, store=store, timeout=float(os.environ.get("PLAIT_SOAK_TIMEOUT", 120)), buffer_bytes=BUFFER
    )
    comms = make_comms(world, rank, n)
    rng = random.Random(seed)  # the sequence: the same on every rank
    local = random.Random(seed * 1000 + rank)  # wait orders: each rank its own
    pending, wrong, done = [], [], 0

    def settle(item):
        handles, check, s = item
        for h in handles if isinstance(handles, list) else [handles]:
            h.wait()
        why = check()
        if why:
            wrong.append("rank %d step %d %s: %s" % (rank, s["i"], s, why))

    t0 = time.monotonic()
    for i in range(steps):
        s = draw(rng, i)
        flush = rng.random() < 0.2 or len(pending) >= MAX_PENDING
        if flush:
            order = list(range(len(pending)))
            local.shuffle(order)  # out of order, and possibly across communicators
            for j in order:
                settle(pending[j])
            pending = []
        comm = comms[s["comm"]]
        if comm is None:
            continue
        handles, check = start(comm, s)
        done += 1
        if handles is None or not s["async"]:
            settle(([], check, s))
        else:
            pending.append((handles, check, s))
    for item in pending:
        settle(item)
    world.barrier()
    elapsed = time.monotonic() - t0
    for c in comms.values():
        if c is not None and c is not world:
            c.finalize()
    world.finalize()
    return {"wrong": wrong, "done": done, "elapsed": elapsed}


CASES = [(n, steps * (20 if LONG else 1), SEED + k) for k, (n, steps) in enumerate(RUNS)]
if LONG:
    CASES += [(n, 20000, SEED + 100 + n) for n in (2, 3, 5, 6, 7, 8)]


@pytest.mark.parametrize("n,steps,seed", CASES, ids=lambda v: str(v))
def test_soak(n, steps, seed, capsys, record_property):
    t0 = time.monotonic()
    results = run_ranks(_soak, n, timeout=max(240, steps * n * 0.05), args=(seed, steps))
    elapsed = time.monotonic() - t0
    wrong = [w for res in results for w in res["wrong"]]
    assert not wrong, "seed %d (PLAIT_SOAK_SEED=%d): %d wrong results, first:\n%s" % (
        seed,
        SEED,
        len(wrong),
        "\n".join(wrong[:10]),
    )
    record_property("elapsed_s", round(elapsed, 2))
    with capsys.disabled():
        print(
            "\n[soak] %d ranks on %d cores: %d collectives (seed %d), %.1f s, 0 wrong; "
            "per rank: %s calls" % (n, os.cpu_count(), steps, seed, elapsed, [res["done"] for res in results])
        )
