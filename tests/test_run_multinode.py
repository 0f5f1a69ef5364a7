"""plait-run --nnodes: two launchers on this machine as two simulated hosts (PLAIT_HOST_ID per node)."""

import json
import socket
import subprocess
import sys
import time

import pytest

from test_run import _ENV, script

pytest.importorskip("torch")  # gloo carries the traffic between the simulated hosts
pytestmark = pytest.mark.slow  # two launchers of two ranks each: full suite only

# Each rank: a hierarchical communicator, an exact allreduce and allgather, its environment.
PROGRAM = """
import numpy as np, plait, signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the test reads what each rank saw before teardown
out = sys.argv[1]
rec = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                  "MASTER_ADDR", "MASTER_PORT", "PLAIT_STORE")}
try:
    comm = plait.init(timeout=30)
    rec["kind"] = type(comm).__name__
    n = comm.size
    rec["sum"] = comm.allreduce(np.arange(5, dtype=np.int64) * (RANK + 1)).tolist()
    rec["gather"] = comm.allgather(np.array([RANK], dtype=np.int32)).ravel().tolist()
    if len(sys.argv) > 2 and RANK == int(sys.argv[2]):
        sys.exit(3)                                    # this rank fails after the first collectives
    if len(sys.argv) > 2:
        for i in range(100000):
            comm.allreduce(np.ones(100))
except plait.PlaitError as e:
    rec["error"] = type(e).__name__
    rec["message"] = str(e)
with open(f"{out}/rank-{RANK}.json", "w") as f:
    json.dump(rec, f)
if "error" in rec:
    time.sleep(2)  # so that the launchers see the failing rank's exit first, even on a loaded machine
sys.exit(1 if "error" in rec else 0)
"""


def _port():
    """A free port whose successor is free too: node 0's launcher serves plait's store at
    MASTER_PORT+1, and node 1's launcher waits for that store for minutes if node 0 could not bind
    it (a port taken by another test made this test time out)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def _nodes(tmp_path, nproc, extra=(), grace=5):
    prog = script(tmp_path, PROGRAM)
    port = _port()
    procs = []
    for node in range(2):
        env = dict(_ENV, PLAIT_HOST_ID=f"node{node}")
        cmd = [
            sys.executable,
            "-m",
            "plait.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--nproc-per-node",
            str(nproc),
            "--grace",
            str(grace),
            str(prog),
            str(tmp_path),
            *map(str, extra),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return port, [p.returncode for p in procs], [e for _, e in outs]


def _records(tmp_path, n):
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(n)]


def test_two_nodes_of_two_ranks(tmp_path):
    port, codes, errs = _nodes(tmp_path, 2)
    assert codes == [0, 0], errs
    recs = _records(tmp_path, 4)
    for r, rec in enumerate(recs):
        assert rec["RANK"] == str(r) and rec["WORLD_SIZE"] == "4"
        assert rec["LOCAL_RANK"] == str(r % 2) and rec["LOCAL_WORLD_SIZE"] == "2"
        assert rec["GROUP_RANK"] == str(r // 2)
        assert rec["MASTER_PORT"] == str(port) and rec["PLAIT_STORE"] == f"127.0.0.1:{port + 1}"
        assert rec["kind"] == "HierCommunicator"
        assert rec["sum"] == [10 * k for k in range(5)]  # (1+2+3+4) * k
        assert rec["gather"] == [0, 1, 2, 3]


def test_rank_failing_on_one_node_stops_both(tmp_path):
    start = time.monotonic()
    _, codes, errs = _nodes(tmp_path, 2, extra=[3])
    assert time.monotonic() - start < 40
    assert codes[1] == 3, errs[1]
    assert "plait-run: node 1: rank 3 (pid" in errs[1] and "failed: exit code 3" in errs[1], errs[1]
    assert codes[0] != 0 and "plait-run: node 0:" in errs[0], errs[0]
    for r in (0, 1, 2):
        rec = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert rec["error"] in ("PeerLostError", "TimeoutError"), rec


def test_usage_errors():
    r = subprocess.run(
        [sys.executable, "-m", "plait.run", "--nnodes", "2", "-n", "1", "x.py"],
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "needs --master-port" in r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.run",
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "--master-port",
            "29500",
            "-n",
            "1",
            "x.py",
        ],
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "is not a node of --nnodes 2" in r.stderr
