"""Kill anywhere: one rank SIGKILLed at a seeded random point, and the launcher itself killed.

Each kill is planned from its seed alone (world size, victim, collective, algorithm, size, sync or
async, and when: before the first collective, between two, or during one), so a failure names
its seed and `PLAIT_FAULT_SEED=<seed> pytest tests/test_faults.py -k kill00` replays it. Every
survivor must raise PeerLostError naming the victim within LOST_WITHIN_S of the kill, and the
communicator's segment (created by rank 0, which is a victim too) must be gone from /dev/shm
without any sweeping. PLAIT_FAULT_KILLS raises the number of kills (default 50).
"""

import glob
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks

BASE_SEED = int(os.environ.get("PLAIT_FAULT_SEED", "6006"))
KILLS = int(os.environ.get("PLAIT_FAULT_KILLS", "50"))
LOST_WITHIN_S = 2.0  # the contract
BUFFER = 8192  # 4 KiB per call: multi-chunk paths from 1 K floats on
RUN_TIMEOUT = 60
COLLS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall", "barrier", "sendrecv")
WORLDS = (2, 2, 3, 4, 5, 8)


def plan(seed):
    """Everything about one kill, drawn from its seed."""
    rng = random.Random(seed)
    coll = COLLS[seed % len(COLLS)]  # every collective, round robin
    n = rng.choice(WORLDS)
    algos = plait.algorithms(coll) if coll not in ("barrier", "sendrecv") else []
    return {
        "seed": seed,
        "n": n,
        "coll": coll,
        "victim": 0 if seed % 4 == 0 else rng.randrange(n),  # rank 0 created the segment
        "algorithm": rng.choice(algos) if algos else None,
        "count": n * rng.choice((1, 7, 64)) if rng.random() < 0.4 else n * rng.randrange(1024, 6144),
        "async": rng.random() < 0.3,
        "when": rng.choice(("before", "between", "during", "during")),
        "after_calls": rng.randrange(1, 8),
        "delay": rng.uniform(0.0, 0.05),
    }


def one_call(comm, p, x, out):
    """Starts the plan's collective; returns the handles to wait for (empty when synchronous)."""
    c, kw, r, n = p["coll"], {"async_op": p["async"]}, comm.rank, comm.size
    if p["algorithm"]:
        kw["algorithm"] = p["algorithm"]
    if c == "allreduce":
        hs = [comm.allreduce(x, out=out, **kw)]
    elif c == "reduce_scatter":
        hs = [comm.reduce_scatter(x, out=out[: x.size // n], **kw)]
    elif c == "allgather":
        hs = [comm.allgather(x[: x.size // n], out=out, **kw)]
    elif c == "broadcast":
        hs = [comm.broadcast(x, root=n - 1, **kw)]
    elif c == "reduce":
        hs = [comm.reduce(x, root=n // 2, out=out, **kw)]
    elif c == "alltoall":
        hs = [comm.alltoall(x, out=out, **kw)]
    elif c == "barrier":
        hs = [comm.barrier(**kw)]
    else:  # a ring exchange; asynchronous so that sends and receives overlap
        hs = [comm.send(x, (r + 1) % n, async_op=True), comm.recv(out, (r - 1) % n, async_op=True)]
        return hs
    return hs if p["async"] else []


def _die(stamp):
    with open(stamp, "w") as f:
        f.write(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)


def _victim_or_survivor(rank, n, store, p, stamp):
    comm = plait.init(rank, n, store=store, timeout=30, buffer_bytes=BUFFER)
    creator = int(comm.allgather(np.array([os.getpid()], np.int64))[0, 0])
    x = np.ones(p["count"], np.float32)
    out = np.empty_like(x)
    me = rank == p["victim"]
    if me and p["when"] == "before":
        _die(stamp)
    if me and p["when"] == "during":
        threading.Timer(p["delay"], _die, args=(stamp,)).start()
    limit = p["after_calls"] if me and p["when"] == "between" else 1 << 30
    t0 = time.monotonic()
    calls = 0
    try:
        while calls < limit:
            for h in one_call(comm, p, x, out):
                h.wait()
            calls += 1
            if time.monotonic() - t0 > 20:
                return {"exc": None, "msg": "no error after %d calls in 20 s" % calls}
    except Exception as e:  # noqa: BLE001 - described to the parent
        at = time.monotonic()
        return {
            "exc": type(e).__name__,
            "msg": str(e),
            "at": at,
            "calls": calls,
            "left": glob.glob("/dev/shm/plait-%d-*" % creator),
        }
    _die(stamp)  # the victim, between two calls


def names_rank(msg, r):
    # The message proper: the flight report appended to it names every rank.
    msg = msg.split("\nflight recorder", 1)[0]
    return re.search(r"\b(?:ranks?|peers?)\b[^.;\n]*?\b%d\b" % r, msg, re.I) is not None


@pytest.mark.parametrize("i", range(KILLS), ids=lambda i: "kill%02d" % i)
def test_kill_anywhere(i, tmp_path):
    p = plan(BASE_SEED + i)
    stamp = str(tmp_path / "killed_at")
    where = "seed %d (PLAIT_FAULT_SEED=%d, kill%02d): %s" % (p["seed"], BASE_SEED, i, p)
    try:
        results = run_ranks(
            _victim_or_survivor, p["n"], timeout=RUN_TIMEOUT, args=(p, stamp), may_die={p["victim"]}
        )
    except BaseException as e:
        raise AssertionError("%s\n%s" % (where, e)) from None
    assert results[p["victim"]] is None, "%s\nthe victim answered: %s" % (where, results[p["victim"]])
    killed_at = float(open(stamp).read())
    for rank, res in enumerate(results):
        if rank == p["victim"]:
            continue
        assert res["exc"] == "PeerLostError", "%s\nrank %d: %s: %s" % (where, rank, res["exc"], res["msg"])
        assert names_rank(res["msg"], p["victim"]), "%s\nrank %d: message does not name rank %d: %s" % (
            where,
            rank,
            p["victim"],
            res["msg"],
        )
        lag = res["at"] - killed_at
        assert lag < LOST_WITHIN_S, "%s\nrank %d raised %.2f s after the kill" % (where, rank, lag)
        assert not res["left"], "%s\nrank %d saw the segment still in /dev/shm: %s" % (
            where,
            rank,
            res["left"],
        )


# ---------------------------------------------------------------- the launcher is killed

PROGRAM = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import plait
    comm = plait.init(timeout=30, buffer_bytes=8192)
    x = np.ones(int(sys.argv[2]), np.float32)
    comm.allreduce(x)
    open(os.path.join(sys.argv[1], "up-%d" % comm.rank), "w").write(str(os.getpid()))
    while True:
        comm.allreduce(x, out=x)
        x[:] = 1
""")


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.parametrize("seed", range(3), ids=lambda s: "seed%d" % s)
def test_launcher_killed(seed, tmp_path):
    """SIGKILL to plait-run: every rank goes within LOST_WITHIN_S (the launcher arms
    PR_SET_PDEATHSIG), and no segment of theirs is left in /dev/shm."""
    rng = random.Random(BASE_SEED * 1000 + seed)
    n, count, pause = rng.choice((2, 3, 4)), rng.choice((16, 5000)), rng.uniform(0, 0.2)
    where = "seed %d (PLAIT_FAULT_SEED=%d): n=%d count=%d pause=%.3f" % (seed, BASE_SEED, n, count, pause)
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "plait.run", "-n", str(n), str(prog), str(tmp_path), str(count)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while len(glob.glob(str(tmp_path / "up-*"))) < n:
            assert launcher.poll() is None, "%s\nthe launcher exited (%s) before the ranks were up" % (
                where,
                launcher.returncode,
            )
            assert time.monotonic() < deadline, "%s\nthe ranks did not come up in 60 s" % where
            time.sleep(0.01)
        time.sleep(0.05)  # every rank has at least published its pid by now
        pids = {r: int(open(tmp_path / ("up-%d" % r)).read()) for r in range(n)}
        time.sleep(pause)
        launcher.kill()
        killed = time.monotonic()
        launcher.wait()
        while any(_alive(p) for p in pids.values()) and time.monotonic() - killed < 10:
            time.sleep(0.01)
        lag = time.monotonic() - killed
        alive = [r for r, p in pids.items() if _alive(p)]
        assert not alive, "%s\nrank(s) %s still alive 10 s after the launcher died" % (where, alive)
        assert lag < LOST_WITHIN_S, "%s\nthe ranks outlived the launcher by %.2f s" % (where, lag)
        left = [s for p in pids.values() for s in glob.glob("/dev/shm/plait-%d-*" % p)]
        assert not left, "%s\nsegments left in /dev/shm: %s" % (where, left)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
