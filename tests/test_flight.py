"""Flight recorder and trace: what survivors can tell about a dead, frozen or disagreeing rank.

Each fault is planned from its seed (world size, victim, when), and every call's collective and
count follow from its call number (plan_call), so a report's entry for a call can be checked
exactly. The victim counts its finished calls in a file; after a kill -9 or SIGSTOP its last
entry in the survivors' report must be that call (finished) or the next (entered).
"""

import glob
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import plait
import pytest
from conftest import run_ranks
from test_run import _ENV

SEED = int(os.environ.get("PLAIT_FLIGHT_SEED", "1414"))
COLLS = ("allreduce", "allgather", "broadcast", "reduce_scatter")


def plan_call(k, n):
    """(collective, count as the report counts it) of call #k (1-based) on n ranks."""
    return COLLS[k % len(COLLS)], n * (1 + (k * 7) % 300)


def do_call(comm, k):
    coll, count = plan_call(k, comm.size)
    n, r = comm.size, comm.rank
    x = np.arange(count, dtype=np.float32) + r
    if coll == "allreduce":
        out = comm.allreduce(x)
        expect = n * np.arange(count, dtype=np.float32) + n * (n - 1) / 2
    elif coll == "allgather":
        out = comm.allgather(x[: count // n])
        expect = np.stack([np.arange(count // n, dtype=np.float32) + p for p in range(n)])
    elif coll == "broadcast":
        out = comm.broadcast(x, root=k % n)
        expect = np.arange(count, dtype=np.float32) + k % n
    else:
        out = comm.reduce_scatter(x)
        b = count // n
        expect = n * np.arange(r * b, (r + 1) * b, dtype=np.float32) + n * (n - 1) / 2
    np.testing.assert_array_equal(out, expect)


def reported_count(coll, count, n):
    """The count a flight record holds: allgather and reduce_scatter count one rank's block."""
    return count // n if coll in ("allgather", "reduce_scatter") else count


def check_entry(call, n):
    coll, count = plan_call(call["call"], n)
    assert call["collective"] == coll and call["count"] == reported_count(coll, count, n), call


def test_report_after_calls():
    def body(rank, n, store):
        comm = plait.init(rank, n, store=store, timeout=30)
        for k in range(1, 11):
            do_call(comm, k)
        comm.barrier()  # call #11: every rank has finished #1..#10
        return plait.dump(comm)

    n = 3
    for rep in run_ranks(body, n):
        assert rep["size"] == n and rep["enabled"] and rep["slots"] == 256
        for r, info in enumerate(rep["ranks"]):
            assert info["rank"] == r and info["untrusted"] == 0 and not info["problems"], info
            calls = [c for c in info["calls"] if c["call"] <= 10]
            assert [c["call"] for c in calls] == list(range(1, 11)), info
            for c in calls:
                check_entry(c, n)
                assert c["state"] == "ok" and c["duration_s"] >= 0 and c["transport"] == "shm"


def _fault_plan(seed):
    rng = random.Random(seed)
    n = rng.choice((2, 3, 4))
    return {"seed": seed, "n": n, "victim": rng.randrange(n), "delay": rng.uniform(0.05, 0.4)}


def _faulty(rank, n, store, p, counter, how):
    comm = plait.init(rank, n, store=store, timeout=30 if how == "kill" else 1.5)
    pids = comm.allgather(np.array([os.getpid()], np.int64))[:, 0]  # call #1
    me = rank == p["victim"]
    fd = os.open(counter, os.O_RDWR | os.O_CREAT) if me else None

    def fault():
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)

    k = 1
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 20:
            k += 1
            do_call(comm, k)
            if me:
                os.pwrite(fd, b"%12d" % k, 0)  # calls finished, read by the test after the fault
                if k == 2:
                    threading.Timer(p["delay"], fault).start()
        return {"exc": None}
    except plait.PlaitError as e:
        out = {"exc": type(e).__name__, "msg": str(e), "flight": e.flight}
    finally:
        survivors = set(range(n)) - {p["victim"]}
        if how == "stop" and not me:
            # The frozen rank is killed once every survivor has its report (a rank being killed
            # looks alive for a moment, neither stopped nor dead).
            open("%s.reported-%d" % (counter, rank), "w").close()
            deadline = time.monotonic() + 20
            while (
                rank == min(survivors)
                and time.monotonic() < deadline
                and not all(os.path.exists("%s.reported-%d" % (counter, r)) for r in survivors)
            ):
                time.sleep(0.01)
            if rank == min(survivors):
                os.kill(int(pids[p["victim"]]), signal.SIGKILL)
    return out


@pytest.mark.parametrize("how", ("kill", "stop"))
@pytest.mark.parametrize("i", range(3))
def test_victim_last_call(how, i, tmp_path):
    p = _fault_plan(SEED + i + (100 if how == "stop" else 0))
    counter = str(tmp_path / "victim_calls")
    results = run_ranks(_faulty, p["n"], timeout=60, args=(p, counter, how), may_die={p["victim"]})
    v, n = p["victim"], p["n"]
    with open(counter, "rb") as f:
        finished = int(f.read())
    for rank, res in enumerate(results):
        if rank == v:
            continue
        where = "%s rank %d: %s" % (p, rank, res)
        assert res["exc"] == ("PeerLostError" if how == "kill" else "TimeoutError"), where
        assert res["flight"] is not None and "\nflight recorder" in res["msg"], where
        rep = res["flight"]["ranks"][v]
        assert rep["calls"], where
        last = rep["calls"][-1]
        # The victim finished `finished` calls: its last entry is that one or the next, entered.
        assert last["call"] in (finished, finished + 1), where
        if last["call"] == finished:
            assert last["state"] == "ok", where
        check_entry(last, n)
        assert rep["state"] == ("dead" if how == "kill" else "stopped"), where
        head = "rank %d last entered %s #%d" % (v, last["collective"], last["call"])
        assert head in res["msg"] and head in res["flight"]["summary"], where
        mine = res["flight"]["ranks"][rank]["calls"][-1]
        assert mine["call"] in (finished, finished + 1, finished + 2), where
        if mine["state"] == "ok":  # the abort came before this rank entered its next call
            first = res["msg"].split("\n", 1)[0]
            assert not first.startswith("rank %d:" % rank) and not first.endswith("by rank %d" % rank), where
        else:
            assert mine["state"] == "failed", where


def _mismatch(rank, n, store, culprit):
    comm = plait.init(rank, n, store=store, timeout=20)
    for k in range(1, 4):
        do_call(comm, k)
    x = np.ones(5 if rank == culprit else 4, np.float32)
    try:
        comm.allreduce(x)  # call #4
        return {"exc": None}
    except plait.PlaitError as e:
        return {"exc": type(e).__name__, "msg": str(e), "flight": e.flight}


@pytest.mark.parametrize("n", (2, 3))
def test_mismatch_report(n):
    culprit = n - 1
    results = run_ranks(_mismatch, n, args=(culprit,))
    seen = 0
    for rank, res in enumerate(results):
        assert res["exc"] == "MismatchError", res
        ranks = res["flight"]["ranks"]
        own = ranks[rank]["calls"][-1]
        if own["call"] == 3:  # the abort came before this rank entered #4
            assert own["state"] == "ok" and n > 2, own
        else:
            assert (own["call"], own["collective"], own["count"], own["state"]) == (
                4,
                "allreduce",
                5 if rank == culprit else 4,
                "failed",
            ), own
        for other in ranks:
            last = other["calls"][-1]
            assert last["call"] in (3, 4), other
            if last["call"] == 4:
                assert last["count"] == (5 if other["rank"] == culprit else 4), other
                seen += other["rank"] == culprit
            else:
                check_entry(last, n)
    assert seen >= 1  # a rank that met the culprit read its call from the culprit's ring
    if n == 2:
        assert seen == 2  # with two ranks each one met the other


def _garbage(rank, n, store, seed):
    comm = plait.init(rank, n, store=store, timeout=20)
    for k in range(1, 21):
        do_call(comm, k)
    comm.barrier()  # #21
    if rank == 0:
        comm._c._flight_scribble(1, seed)
    comm.barrier()  # #22
    rep = plait.dump(comm)
    x = np.full(8, rank + 1, np.float32)
    assert comm.allreduce(x).tolist() == [n * (n + 1) / 2] * 8  # still works: #23
    return rep


@pytest.mark.parametrize("seed", (1, 2, 3))
def test_garbage_ring_reported_not_trusted(seed):
    n = 3
    results = run_ranks(_garbage, n, args=(seed,), env={"PLAIT_FLIGHT_SIZE": "16"})
    for rep in results:
        bad = rep["ranks"][1]
        assert bad["untrusted"] >= 12 and bad["problems"], bad
        assert bad["recorded"] in (22, 23), bad
        for c in bad["calls"]:  # anything still trusted is a real call made around the scribble
            assert (c["collective"], c["call"]) in (("barrier", 21), ("barrier", 22), ("allreduce", 23)), c
        for r in (0, 2):
            good = rep["ranks"][r]
            assert good["untrusted"] == 0 and not good["problems"], good
            early = [c for c in good["calls"] if c["call"] <= 20]
            assert [c["call"] for c in early] == list(range(21 - len(early), 21)) and len(early) >= 13
            for c in early:
                check_entry(c, n)
        assert "rank 1" in rep["summary"]


def _off(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=20)
    for k in range(1, 6):
        do_call(comm, k)
    rep = plait.dump(comm)
    try:
        comm.allreduce(np.ones(3 + rank, np.float32))
        return rep, None
    except plait.MismatchError as e:
        return rep, (e.flight, str(e))


def test_flight_off():
    for rep, err in run_ranks(_off, 2, env={"PLAIT_FLIGHT": "0"}):
        assert not rep["enabled"] and rep["slots"] == 0 and rep["ranks"] == []
        assert err is not None and err[0] is None and "flight recorder" not in err[1]


def _traced(rank, n, store, calls):
    comm = plait.init(rank, n, store=store, timeout=30)
    comm.label = "pg:trainer"
    for k in range(1, calls + 1):
        do_call(comm, k)
    x = np.arange(10, dtype=np.int64)
    if rank == 0:
        comm.send(x, 1, tag=3)
    elif rank == 1:
        comm.recv(x, 0, tag=3)
    comm.allreduce(np.ones(4, np.float32), async_op=True).wait()
    plait.finalize()
    return os.getpid()


def test_trace_one_slice_per_call(tmp_path):
    n, calls = 2, 300  # more than a flush's worth (256)
    pids = run_ranks(_traced, n, args=(calls,), env={"PLAIT_TRACE": str(tmp_path)})
    for rank in range(n):
        path = tmp_path / ("trace-rank%d-%d.json" % (rank, pids[rank]))
        events = json.loads(path.read_text())
        slices = [e for e in events if e["ph"] == "X"]
        names = [e["name"] for e in slices]
        want = [plan_call(k, n)[0] for k in range(1, calls + 1)]
        want += ["send" if rank == 0 else "recv", "allreduce"]
        assert names == want
        for k, e in enumerate(slices[:calls], 1):
            coll, count = plan_call(k, n)
            a = e["args"]
            assert a["call"] == k and a["count"] == reported_count(coll, count, n), e
            assert a["bytes"] == 4 * a["count"] and a["dtype"] == "float32" and a["ok"] is True
            assert a["algorithm"] in plait.algorithms(coll)
            assert e["dur"] >= 0 and 0 <= a["wait_us"] and 0 <= a["data_us"]
            assert e["pid"] == rank
        assert slices[calls]["args"]["peer"] == 1 - rank and slices[calls]["args"]["tag"] == 3
        tracks = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
        assert any(t.startswith("pg:trainer") for t in tracks), tracks


SCRIPT = """
import sys
import numpy as np
import plait
comm = plait.init(timeout=20)
for k in range(3):
    comm.allreduce(np.ones(16, np.float32))
comm.allreduce(np.ones(16 + comm.rank, np.float32))  # call #4 disagrees
"""


def test_dump_on_error_launcher_prints_once(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(SCRIPT)
    dump_dir = tmp_path / "dumps"
    env = _ENV  # the plait under test, installed or on PYTHONPATH, not the checkout's sources
    before = set(glob.glob("/dev/shm/plait-*"))
    r = subprocess.run(
        [sys.executable, "-m", "plait.run", "-n", "2", "--dump-on-error", str(dump_dir), str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    files = sorted(os.listdir(dump_dir))
    assert files == ["flight-rank0.json", "flight-rank1.json"], (files, r.stderr)
    for name in files:
        rep = json.loads((dump_dir / name).read_text())
        assert rep["error"].startswith("mismatched calls")
        for info in rep["ranks"]:
            last = info["calls"][-1]
            assert (last["call"], last["count"]) == (4, 16 + info["rank"]), info
    out = r.stdout + r.stderr
    assert out.count("flight recorder: 2 report(s)") == 1, out
    assert out.count("last entered allreduce #4") == 2, out  # one line per rank, printed once
    assert "report written to" in out  # the ranks' own messages point at their files
    assert set(glob.glob("/dev/shm/plait-*")) <= before


def _torch_traced(rank, n, store, store_dir):
    from datetime import timedelta

    import plait.torch
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    path = os.path.join(store_dir, "store-flight")
    dist.init_process_group(
        "plait", init_method="file://" + path, rank=rank, world_size=n, timeout=timedelta(seconds=60)
    )
    sub = dist.new_group([0, 1])
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    assert t.tolist() == [float(n * (n + 1) // 2 * 2)] * 4
    names = (dist.group.WORLD.group_name, sub.group_name)
    dist.destroy_process_group()
    plait._C.flush_traces()
    return names, os.getpid()


def test_torch_calls_traced_with_group_names(tmp_path):
    pytest.importorskip("torch")
    n = 2
    res = run_ranks(_torch_traced, n, args=(str(tmp_path),), env={"PLAIT_TRACE": str(tmp_path)})
    for rank, ((world, sub), pid) in enumerate(res):
        events = json.loads((tmp_path / ("trace-rank%d-%d.json" % (rank, pid))).read_text())
        tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        for group in (world, sub):
            tids = [t for t, name in tracks.items() if name.startswith("pg:%s " % group)]
            assert len(tids) == 1, (group, tracks)
            reduces = [
                e for e in events if e["ph"] == "X" and e["tid"] == tids[0] and e["name"] == "allreduce"
            ]
            assert len(reduces) == 1 and reduces[0]["args"]["count"] == 4, reduces


def test_bench_trace(tmp_path):
    env = _ENV  # the plait under test, installed or on PYTHONPATH, not the checkout's sources
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.bench",
            "-n",
            "2",
            "-b",
            "8",
            "-e",
            "8",
            "-c",
            "allreduce",
            "--time",
            "0.02",
            "--trials",
            "1",
            "--trace",
            str(tmp_path / "tr"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    files = sorted(glob.glob(str(tmp_path / "tr" / "trace-rank*.json")))
    assert [os.path.basename(f).split("-")[1] for f in files] == ["rank0", "rank1"], files
    counts = []
    for f in files:
        with open(f) as fh:
            slices = [e for e in json.load(fh) if e["ph"] == "X"]
        assert slices and {e["name"] for e in slices} <= {"allreduce", "barrier", "allgather", "broadcast"}
        assert [e["args"]["call"] for e in slices] == list(range(1, len(slices) + 1))  # none lost
        counts.append(len(slices))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("value", ("0", "65537", "x"))
def test_flight_size_must_be_a_count(value, monkeypatch):
    from plait import _comm

    monkeypatch.setenv("PLAIT_FLIGHT_SIZE", value)
    with pytest.raises(plait.InvalidArgument, match="PLAIT_FLIGHT_SIZE"):
        _comm.flight_slots()
    monkeypatch.setenv("PLAIT_FLIGHT", "0")
    assert _comm.flight_slots() == 0
