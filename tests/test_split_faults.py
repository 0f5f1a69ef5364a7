"""split() when a member dies in it, or the leader cannot create the new segment: the survivors
raise at once naming the rank and the reason, and the new segment does not outlive the step that
failed (checked before any later sweep could tidy up). Also: buffers (memoryview) as inputs."""

import os
import random
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks
from plait import _C, _comm, _shm
from plait._store import Store

POINTS = ["before_records", "after_records", "after_open"]


def _arm(point, stamp):
    """SIGKILLs this process at `point` of its next split (patched where split looks them up)."""

    def die():
        with open(stamp, "w") as f:
            f.write(repr(time.monotonic()))
        os.kill(os.getpid(), 9)

    if point == "before_records":  # the leader has created the segment, the others wait for it
        ag = _comm.Communicator.allgather
        calls = []

        def allgather(self, x, *a, **k):
            calls.append(1)
            if len(calls) == 2:
                die()
            return ag(self, x, *a, **k)

        _comm.Communicator.allgather = allgather
    elif point == "after_records":
        ag = _comm.Communicator.allgather
        calls = []

        def allgather_then_die(self, x, *a, **k):
            out = ag(self, x, *a, **k)
            calls.append(1)
            if len(calls) == 2:
                die()
            return out

        _comm.Communicator.allgather = allgather_then_die
    else:
        for name in ("open_segment", "create_segment"):
            made = getattr(_comm, name)

            def make_then_die(info, _made=made):
                seg = _made(info)
                die()
                return seg

            setattr(_comm, name, make_then_die)


def _split_dies(rank, n, addr, p, stamp):
    comm = plait.init(rank, n, timeout=10, set_default=False)
    Store(*addr, timeout=5).set(f"pid/{rank}", str(os.getpid()))
    comm.barrier()
    pids = {int(Store(*addr, timeout=5).get(f"pid/{r}")) for r in range(n)}
    if rank == p["victim"]:
        _arm(p["point"], stamp)
    try:
        sub = comm.split(0, key=rank)
        sub.allreduce(np.ones(2))
        return {"exc": None}
    except plait.PlaitError as e:
        at = time.monotonic()
        left = [s for s in _shm.list_segments() if int(_shm._NAME.match(s)[1]) in pids]
        return {"exc": type(e).__name__, "msg": str(e), "at": at, "left": left}
    finally:
        comm.finalize()


def _plans():
    out = []
    for seed in range(6):
        rng = random.Random(seed)
        n = 2 + seed % 2
        out.append({"n": n, "victim": rng.randrange(n), "point": POINTS[seed // 2]})
    return out


@pytest.mark.parametrize("p", _plans(), ids=lambda p: "%(point)s-n%(n)d-v%(victim)d" % p)
def test_rank_killed_in_split(p, tmp_path):
    stamp = str(tmp_path / "killed_at")
    results = run_ranks(_split_dies, p["n"], timeout=60, args=(p, stamp), may_die={p["victim"]})
    killed_at = float(open(stamp).read())
    for rank, res in enumerate(results):
        if rank == p["victim"]:
            continue
        where = "plan %s, rank %d" % (p, rank)
        assert res["exc"] == "PeerLostError", "%s: %s" % (where, res)
        assert "rank %d" % p["victim"] in res["msg"], "%s: %s" % (where, res["msg"])
        assert res["at"] - killed_at < 2.0, "%s: %.2f s: %s" % (where, res["at"] - killed_at, res["msg"])
        assert res["left"] == [], "%s: left in /dev/shm: %s" % (where, res["left"])


def _split_no_space(rank, n, addr):
    comm = plait.init(rank, n, timeout=10, set_default=False)
    if rank == 0:  # the leader: creating the segment fails as a full /dev/shm makes it fail

        def full(info):
            raise plait.PlaitError("cannot create shared memory %s: No space left on device" % info["name"])

        _comm.create_segment = full
    t0 = time.monotonic()
    try:
        comm.split(0)
        return None
    except plait.PlaitError as e:
        return {"msg": str(e), "s": time.monotonic() - t0}
    finally:
        comm.finalize()


@pytest.mark.parametrize("n", [2, 3])
def test_split_failure_reason_reaches_every_member(n):
    for rank, res in enumerate(run_ranks(_split_no_space, n, timeout=60)):
        assert res is not None, rank
        assert "No space left on device" in res["msg"], (rank, res["msg"])
        assert res["s"] < 2.0, (rank, res)
        if rank:
            assert "rank 0" in res["msg"], res["msg"]


def _memoryview(rank, n, addr):
    comm = plait.init(rank, n, set_default=False)
    buf = np.arange(6, dtype=np.int64) * (rank + 1)
    out = comm.allreduce(memoryview(buf))
    target = np.zeros(6, dtype=np.int64)
    comm.allreduce(memoryview(buf), out=memoryview(target))
    gathered = comm.allgather(memoryview(bytearray(bytes([rank] * 3))))
    try:
        comm.allreduce(memoryview(b"abc").cast("c"))
        bad = None
    except plait.InvalidArgument as e:
        bad = str(e)
    comm.finalize()
    return out.tolist(), target.tolist(), np.asarray(gathered).tolist(), bad


@pytest.mark.parametrize("n", [2, 3])
def test_memoryview_inputs(n):
    total = n * (n + 1) // 2
    for out, target, gathered, bad in run_ranks(_memoryview, n, timeout=60):
        assert out == [i * total for i in range(6)]
        assert target == out
        assert gathered == [[r] * 3 for r in range(n)]
        assert bad is not None, bad


def test_check_env_binding_names_the_variable(monkeypatch):
    monkeypatch.setenv("PLAIT_ASYNC_GRACE_US", "soon")
    with pytest.raises(plait.InvalidArgument, match="PLAIT_ASYNC_GRACE_US"):
        _C.check_env()
