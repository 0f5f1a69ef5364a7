"""A rank that dies or fails while a communicator is being set up (plait.init, a torch group's
creation, split): the others raise at once, naming it and why, and /dev/shm keeps nothing of it.

Kill points are seeded: each plan picks the world size, the victim and the step of the rendezvous
after which the victim SIGKILLs itself (after its arrival, after announcing itself, after the host
table, after creating or opening the segment). A victim that dies before announcing itself cannot
be told from a late one: the others then raise at the init timeout, which these tests keep short.
"""

import json
import os
import random
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks
from plait import _bootstrap, _comm, _hosts, _shm, _store

POINTS = ["arrived", "announced", "exchanged", "segment"]
SEEDS = range(8)
INIT_TIMEOUT = 4.0


def _plan(seed):
    rng = random.Random(seed)
    n = 2 + seed % 2  # both world sizes, each point twice
    return {"n": n, "victim": rng.randrange(n), "point": POINTS[seed // 2 % len(POINTS)]}


def _die(stamp):
    with open(stamp, "w") as f:
        f.write(repr(time.monotonic()))
    os.kill(os.getpid(), 9)


def _arm(point, stamp, store_cls):
    """Makes this process SIGKILL itself at `point` of its next rendezvous."""
    if point == "arrived":
        add = store_cls.add

        def add_then_die(self, key, delta):
            v = add(self, key, delta)
            if "/arrivals/" in key:
                _die(stamp)
            return v

        store_cls.add = add_then_die
    elif point == "announced":
        put = store_cls.set

        def set_then_die(self, key, value):
            put(self, key, value)
            if "/host/" in key:
                _die(stamp)

        store_cls.set = set_then_die
    elif point == "exchanged":
        exchange = _hosts.exchange

        def exchange_then_die(*a, **k):
            ids = exchange(*a, **k)
            _die(stamp)
            return ids

        _hosts.exchange = exchange_then_die
    else:
        for name in ("create_segment", "open_segment"):
            made = getattr(_comm, name)

            def make_then_die(info, _made=made):
                seg = _made(info)
                _die(stamp)
                return seg

            setattr(_comm, name, make_then_die)


def _mine(pids):
    return sorted(
        s for s in _shm.list_segments() if _shm._NAME.match(s) and int(_shm._NAME.match(s)[1]) in pids
    )


def _join(rank, n, addr, p, stamp):
    client = _store.Store(*addr, timeout=10)
    client.set(f"pid/{rank}", str(os.getpid()))
    if rank == p["victim"]:
        _arm(p["point"], stamp, _store.Store)
    t0 = time.monotonic()
    try:
        comm = plait.init(rank, n, timeout=INIT_TIMEOUT, init_timeout=INIT_TIMEOUT, set_default=False)
        comm.allreduce(np.arange(4.0))
        comm.finalize()
        return {"exc": None}
    except plait.PlaitError as e:
        at = time.monotonic()
        pids = {int(client.get(f"pid/{r}")) for r in range(n)}
        return {"exc": type(e).__name__, "msg": str(e), "at": at, "t0": t0, "left": _mine(pids)}


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: "seed%d" % s)
def test_rank_killed_during_init(seed, tmp_path):
    p = _plan(seed)
    stamp = str(tmp_path / "killed_at")
    results = run_ranks(_join, p["n"], timeout=40, args=(p, stamp), may_die={p["victim"]})
    killed_at = float(open(stamp).read())
    for rank, res in enumerate(results):
        if rank == p["victim"]:
            continue
        where = "plan %s, rank %d" % (p, rank)
        assert res["exc"] is not None, "%s: init and a collective went on after the kill" % where
        assert res["left"] == [], "%s: left in /dev/shm: %s" % (where, res["left"])
        if p["point"] == "arrived":  # never announced: only the init timeout can end the wait
            assert res["exc"] == "TimeoutError", "%s: %s: %s" % (where, res["exc"], res["msg"])
            assert res["at"] - res["t0"] < INIT_TIMEOUT + 2.0, where
            continue
        assert res["exc"] == "PeerLostError", "%s: %s: %s" % (where, res["exc"], res["msg"])
        assert "rank %d" % p["victim"] in res["msg"], "%s: %s" % (where, res["msg"])
        assert res["at"] - killed_at < 2.0, "%s: raised %.2f s after the kill: %s" % (
            where,
            res["at"] - killed_at,
            res["msg"],
        )


def _fail_setup(rank, n, addr, setting):
    if rank == n - 1:  # one rank's setting is bad
        name, value = setting
        os.environ[name] = value
    t0 = time.monotonic()
    try:
        plait.init(rank, n, init_timeout=30, set_default=False).finalize()  # PLAIT_TIMEOUT applies
        return {"exc": None}
    except plait.PlaitError as e:
        return {"exc": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}


BAD = [
    ("PLAIT_ALGO", "allreduce=nonesuch"),
    ("PLAIT_ASYNC_GRACE_US", "soon"),
    ("PLAIT_ASYNC_DEFER_BYTES", "-1"),
    ("PLAIT_BUFFER_BYTES", "64k"),
    ("PLAIT_TIMEOUT", "nan"),
    ("PLAIT_SINGLE_COPY", "off"),
]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("setting", BAD, ids=[b[0] for b in BAD])
def test_one_rank_fails_setup_every_rank_raises_why(n, setting):
    results = run_ranks(_fail_setup, n, timeout=40, args=(setting,))
    for rank, res in enumerate(results):
        assert res["exc"] == "InvalidArgument", (rank, res)
        assert setting[0] in res["msg"], (rank, res["msg"])
        assert res["s"] < 5.0, (rank, res)  # not the 30 s init deadline
        if rank != n - 1:
            assert "rank %d" % (n - 1) in res["msg"], res["msg"]


def _init_raises(rank, n, addr, bad_rank):
    """One rank's init raises (its store client refuses a bad wait): the others hear why."""
    t0 = time.monotonic()
    try:
        if rank == bad_rank:
            plait.init(rank, n, timeout=30, init_timeout=float("nan"), set_default=False)
        else:
            plait.init(rank, n, timeout=30, init_timeout=30, set_default=False).finalize()
        return {"exc": None}
    except plait.PlaitError as e:
        return {"exc": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}


@pytest.mark.parametrize("n", [2, 3])
def test_exception_in_one_ranks_init_reaches_the_others(n):
    results = run_ranks(_init_raises, n, timeout=40, args=(0,))
    for rank, res in enumerate(results):
        assert res["exc"] == "InvalidArgument", (rank, res)
        assert "init_timeout" in res["msg"], (rank, res["msg"])
        assert res["s"] < 5.0, (rank, res)


def test_env_values_named_before_any_wait(monkeypatch):
    monkeypatch.setenv("PLAIT_BUFFER_BYTES", "12x")
    with pytest.raises(plait.InvalidArgument, match="PLAIT_BUFFER_BYTES='12x'"):
        _bootstrap.check_env()
    monkeypatch.delenv("PLAIT_BUFFER_BYTES")
    monkeypatch.setenv("PLAIT_ALGO", "allreduce=nonesuch")
    with pytest.raises(plait.InvalidArgument, match="PLAIT_ALGO"):
        _bootstrap.check_env()
    monkeypatch.delenv("PLAIT_ALGO")
    for name, value in (
        ("PLAIT_INTER", "tcp"),
        ("PLAIT_FLIGHT_SIZE", "lots"),
        ("PLAIT_FLIGHT", "no"),
        ("PLAIT_HIER_CHECK", "false"),
        ("PLAIT_GPU_TRANSPORT", "nvlink"),
        ("PLAIT_REDUCE_ISA", "sse"),
        ("PLAIT_GPU_CHUNK_BYTES", "4k"),
        ("PLAIT_GPU_IPC_BYTES", "0"),
        ("PLAIT_GPU_WATCHDOG_MS", "-5"),
    ):
        monkeypatch.setenv(name, value)
        with pytest.raises(plait.InvalidArgument, match=name):
            _bootstrap.check_env()
        monkeypatch.delenv(name)
    monkeypatch.setenv("PLAIT_STORE", "127.0.0.1:99999")
    t0 = time.monotonic()
    with pytest.raises(plait.InvalidArgument, match="99999"):
        plait.init(0, 2, set_default=False)
    assert time.monotonic() - t0 < 1.0


def _malformed_segment(rank, n, addr):
    client = _store.Store(*addr, timeout=10)
    try:
        if rank == 0:  # an impostor rank 0 of a 2-rank world publishes a forged segment record
            client.add("plait/claims/0", 1)
            client.add("plait/arrivals/0", 1)
            client.set("plait/0/host/0", f"h\nm\n{_fake_identity()}")
            client.get("plait/0/host/1", timeout=10)
            client.set("plait/0/hosts", json.dumps([f"h\nm\n{_fake_identity()}"] * 2).encode())
            client.set("plait/0/segment", b'{"name": "/etc/passwd", "size": 2}')
            client.wait(["plait/0/error"], timeout=10)
            return {"exc": None}
        plait.init(rank, n, timeout=5, init_timeout=5, set_default=False)
        return {"exc": None}
    except plait.PlaitError as e:
        return {"exc": type(e).__name__, "msg": str(e)}


def _fake_identity():
    return "elsewhere ns 12345 1"


def test_forged_segment_record_is_refused():
    results = run_ranks(_malformed_segment, 2, timeout=30)
    assert results[1]["exc"] == "InvalidArgument", results
    assert "segment record" in results[1]["msg"], results
