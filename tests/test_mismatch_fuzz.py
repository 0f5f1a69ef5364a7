"""Disagreeing ranks, fuzzed: one seeded culprit changes one field of a call, skips it or makes an
extra one. Every rank must raise MismatchError or TimeoutError naming the culprit (and, for a
mismatch, the field), and a call that does return must have returned the right data.

Each run_ranks spawn plays many trials, each on a fresh communicator (plait.init again on the
same store), so the fuzzing costs one fork per world size. PLAIT_MISMATCH_SEED replays a run.
"""

import os
import random
import re
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks

SEED = int(os.environ.get("PLAIT_MISMATCH_SEED", "4242"))
TRIALS = int(os.environ.get("PLAIT_MISMATCH_TRIALS", "14"))
CALL_TIMEOUT = 1.5
FIELDS = ("collective", "count", "dtype", "op", "root", "algorithm", "skip", "extra")
WORD = {
    "collective": r"collective",
    "count": r"count",
    "dtype": r"dtype",
    "op": r"\bop\b",
    "root": r"root",
    "algorithm": r"algorithm",
}
REDUCING = ("allreduce", "reduce_scatter", "reduce")


def trial(seed, n):
    """One disagreement: the honest call, the culprit's variant and how the sequence differs."""
    rng = random.Random(seed)
    field = rng.choice(FIELDS)
    culprit = rng.randrange(n)
    honest = {
        "coll": rng.choice(("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall")),
        "count": n * rng.choice((1, 3, 700, 3000)),
        "dtype": rng.choice(("float32", "int32", "float64")),
        "op": rng.choice(("sum", "max")),
        "root": rng.randrange(n),
        "algorithm": "auto",
    }
    bad = dict(honest)
    if field == "collective":
        bad["coll"] = rng.choice(
            [c for c in ("allreduce", "allgather", "broadcast", "alltoall") if c != honest["coll"]]
        )
    elif field == "count":
        bad["count"] = honest["count"] + n * rng.choice((1, 2, 100))
    elif field == "dtype":
        bad["dtype"] = rng.choice(
            [d for d in ("float32", "int32", "float64", "int64") if d != honest["dtype"]]
        )
    elif field == "op":
        honest["coll"] = rng.choice(REDUCING)
        bad = dict(honest, op=rng.choice([o for o in ("sum", "max", "min", "prod") if o != honest["op"]]))
    elif field == "root":
        honest["coll"] = rng.choice(("broadcast", "reduce"))
        bad = dict(honest, root=(honest["root"] + rng.randrange(1, n)) % n)
    elif field == "algorithm":
        honest["coll"] = rng.choice(
            ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall")
        )
        a, b = rng.sample(plait.algorithms(honest["coll"]), 2)
        honest["algorithm"], bad = a, dict(honest, algorithm=b)
    # The next call differs from the first in its count, so a skipped or extra call shows up as
    # a mismatch rather than as two calls plait cannot tell apart.
    after = dict(honest, count=honest["count"] + n)
    return {"seed": seed, "field": field, "culprit": culprit, "honest": honest, "bad": bad, "after": after}


def issue(comm, spec, salt):
    """Runs one call; returns None if its result is right, else a description."""
    r, n = comm.rank, comm.size
    dt, c = np.dtype(spec["dtype"]), spec["count"]
    x = np.full(c, r + 1 + salt, dt)
    coll, kw = spec["coll"], {}
    if spec["algorithm"] != "auto":
        kw["algorithm"] = spec["algorithm"]
    vals = np.arange(1, n + 1, dtype=np.float64) + salt
    red = {"sum": vals.sum(), "max": vals.max(), "min": vals.min(), "prod": vals.prod()}.get(spec["op"])
    if coll == "allreduce":
        got, want = comm.allreduce(x, op=spec["op"], **kw), red
    elif coll == "reduce_scatter":
        got, want = comm.reduce_scatter(x, op=spec["op"], **kw), red
    elif coll == "reduce":
        got, want = comm.reduce(x, root=spec["root"], op=spec["op"], **kw), red
        if r != spec["root"]:
            return None
    elif coll == "allgather":
        got = comm.allgather(x, **kw)
        return None if np.array_equal(got, np.repeat(vals, c).reshape(n, c).astype(dt)) else "allgather wrong"
    elif coll == "broadcast":
        got, want = comm.broadcast(x, root=spec["root"], **kw), spec["root"] + 1 + salt
    else:
        got = comm.alltoall(x, **kw)
        return None if np.array_equal(got, np.repeat(vals, c // n).astype(dt)) else "alltoall wrong"
    return (
        None
        if np.array_equal(got, np.full(got.shape, want).astype(dt))
        else ("%s returned %s, want %s" % (coll, got[:4], want))
    )


def _fuzz(rank, n, store, seeds):
    seen = []
    for seed in seeds:
        t = trial(seed, n)
        culprit = rank == t["culprit"]
        calls = [t["honest"], t["after"]]
        if culprit and t["field"] == "skip":
            calls = calls[1:]
        elif culprit and t["field"] == "extra":
            calls = [t["after"]] + calls
        elif culprit:
            calls = [t["bad"], t["after"]]
        comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
        wrong, res = [], {"exc": None, "msg": "every call returned"}
        t0 = time.monotonic()
        try:
            for k, spec in enumerate(calls):
                why = issue(comm, spec, k)
                if why:
                    wrong.append(why)
            comm.barrier()
        except Exception as e:  # noqa: BLE001 - described to the parent
            res = {"exc": type(e).__name__, "msg": str(e), "plait": isinstance(e, plait.PlaitError)}
        res.update(trial=t, wrong=wrong, t=time.monotonic() - t0)
        comm.finalize()
        seen.append(res)
    return seen


def names_rank(msg, r):
    # The message proper: the flight report appended to it names every rank.
    msg = msg.split("\nflight recorder", 1)[0]
    return re.search(r"\b(?:ranks?|peers?)\b[^.;\n]*?\b%d\b" % r, msg, re.I) is not None


@pytest.mark.parametrize("n", (2, 3, 4, 6))
def test_mismatch_fuzz(n):
    seeds = [SEED * 100 + n * 1000 + k for k in range(TRIALS)]
    results = run_ranks(_fuzz, n, timeout=120, args=(seeds,))
    for k in range(TRIALS):
        for rank in range(n):
            res = results[rank][k]
            t = res["trial"]
            where = "PLAIT_MISMATCH_SEED=%d n=%d trial seed %d rank %d: %s" % (SEED, n, t["seed"], rank, t)
            assert not res["wrong"], "%s\nwrong data: %s" % (where, res["wrong"])
            assert res["exc"] in ("MismatchError", "TimeoutError") and res["plait"], "%s\ngot %s: %s" % (
                where,
                res["exc"],
                res["msg"],
            )
            assert names_rank(res["msg"], t["culprit"]), "%s\nthe culprit is not named: %s" % (
                where,
                res["msg"],
            )
            if res["exc"] == "MismatchError" and t["field"] in WORD:
                assert re.search(WORD[t["field"]], res["msg"].split("\nflight recorder", 1)[0]), (
                    "%s\nfield not named: %s" % (where, res["msg"])
                )
