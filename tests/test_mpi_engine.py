"""plait._mpi, the MPI engine between hosts (csrc/hier/mpi_engine.cc), under a real mpirun: every
engine function on exact integer data, timeouts, and the job-wide flag. The checks each rank runs
are in mpi_engine_checks.py."""

import importlib.util
import os
import shutil
import subprocess
import sys
import time

import pytest

from test_run import _ENV


def _why():
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed"
    if importlib.util.find_spec("plait._mpi") is None:
        return "plait was built without MPI (no MPI found at build time, or PLAIT_MPI=OFF)"
    return None


WHY = _why()
pytestmark = pytest.mark.skipif(
    WHY is not None,
    reason=f"{WHY} (apt-get install openmpi-bin libopenmpi-dev && pip install mpi4py, then rebuild plait)",
)
HERE = os.path.dirname(os.path.abspath(__file__))
CHECKS = os.path.join(HERE, "mpi_engine_checks.py")
P2P = os.path.join(HERE, "mpi_p2p_checks.py")


def _start(tmp_path, case, n, env=(), checks=CHECKS):
    cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return subprocess.run(
        cmd + [sys.executable, checks, case, str(tmp_path)],
        env=dict(_ENV, **dict(env)),
        capture_output=True,
        text=True,
        timeout=180,
    )


def _mpirun(tmp_path, case, n, env=(), checks=CHECKS):
    r = _start(tmp_path, case, n, env, checks)
    got = {}
    for rank in range(n):
        path = tmp_path / f"{case}-{rank}"
        got[rank] = path.read_text() if path.exists() else "(no result)"
    bad = {rank: text for rank, text in got.items() if not text.startswith("ok ")}
    assert not bad and r.returncode == 0, (bad, r.stdout[-2000:], r.stderr[-2000:])
    return [int(text.split()[1]) for text in got.values()]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("chunk", [None, "40"], ids=["one-piece", "40-byte-pieces"])
def test_every_function_exact(tmp_path, n, chunk):
    """Every function and supported (dtype, op), counts 0/1/7/3001; with 40-byte pieces every
    count above a few elements takes the multi-piece path that counts past 2^31 take."""
    checks = _mpirun(tmp_path, "exact", n, {"PLAIT_MPI_CHUNK_BYTES": chunk} if chunk else {})
    # 45 supports(), 4 counts x 7 dtypes x (4 ops + the 4 started together + allgather twice +
    # alltoall + n broadcasts), 2 point-to-point per count, 5 refused arguments, and rank 1's two
    # mismatched receives
    base = 45 + 4 * 7 * (8 + n) + 4 * 2 + 5
    assert checks == [base + 2 * (r == 1) for r in range(n)], checks


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("chunk", [None, "40"], ids=["one-piece", "40-byte-pieces"])
def test_probe_finds_each_sender_once(tmp_path, n, chunk):
    """probe(tag) names a ready message's sender and size (not the size where a message may be
    the first of several pieces); a recv from that sender takes exactly it."""
    checks = _mpirun(tmp_path, "probe", n, {"PLAIT_MPI_CHUNK_BYTES": chunk} if chunk else {})
    assert checks == [1 + 3 * (n - 1) + 1] + [1] * (n - 1), checks


@pytest.mark.parametrize("n", [2, 3])
def test_timeout(tmp_path, n):
    assert _mpirun(tmp_path, "timeout", n) == [4 + 2 * (r == 1) for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_fail_reaches_every_member(tmp_path, n):
    assert _mpirun(tmp_path, "fail", n) == [2] * n


@pytest.mark.parametrize("case", ["fail_mismatch", "fail_invalid"])
def test_fail_keeps_its_kind(tmp_path, case):
    assert _mpirun(tmp_path, case, 3) == [2] * 3


def test_fail_reaches_other_groups(tmp_path):
    assert _mpirun(tmp_path, "fail_across_groups", 3) == [1] * 3


def test_fail_from_another_thread_during_a_call(tmp_path):
    assert _mpirun(tmp_path, "fail_from_thread", 3) == [1] * 3


def test_killed_rank_ends_the_job(tmp_path):
    """kill -9 of one rank while the other waits in the engine: mpirun ends the whole job within
    seconds (Open MPI's default); the waiting rank neither hangs nor returns a result."""
    t0 = time.monotonic()
    r = _start(tmp_path, "killed", 2)
    took = time.monotonic() - t0
    assert r.returncode != 0 and took < 60, (r.returncode, took, r.stderr[-2000:])
    assert not (tmp_path / "killed-0").exists(), (tmp_path / "killed-0").read_text()
    assert not (tmp_path / "killed-1").exists()


# p2p_start / p2p_test (mpi_p2p_checks.py): counts 0, 1, 7, 3001 and, in whole pieces, 1 MiB
P2P_COUNTS = {None: 5, "40": 4}


@pytest.mark.parametrize("chunk", [None, "40"], ids=["one-piece", "40-byte-pieces"])
def test_p2p_exchange_does_not_wait_on_itself(tmp_path, chunk):
    """Both members start a recv, then send blocking, then finish the recv; and the mirror."""
    env = {"PLAIT_MPI_CHUNK_BYTES": chunk} if chunk else {}
    assert _mpirun(tmp_path, "exchange_all", 2, env, P2P) == [2 * P2P_COUNTS[chunk] + 3] * 2


@pytest.mark.parametrize("chunk", [None, "40"], ids=["one-piece", "40-byte-pieces"])
def test_p2p_ring_all_started_before_any_test(tmp_path, chunk):
    env = {"PLAIT_MPI_CHUNK_BYTES": chunk} if chunk else {}
    assert _mpirun(tmp_path, "ring", 3, env, P2P) == [P2P_COUNTS[chunk]] * 3


def test_p2p_one_pair_completes_in_start_order(tmp_path):
    assert _mpirun(tmp_path, "in_order", 2, {}, P2P) == [50, 50]


def test_p2p_size_mismatch(tmp_path):
    """Longer and shorter messages: MismatchError naming the message's size, nothing written past
    the buffer; the groups stay usable unless a longer message may have more pieces behind it."""
    assert _mpirun(tmp_path, "mismatch", 2, {}, P2P) == [4, 4 + 2 + 2 + 1 + 2]


def test_p2p_timeout(tmp_path):
    assert _mpirun(tmp_path, "timeout", 2, {}, P2P) == [5, 2]


def test_p2p_fail_reaches_transfers_in_flight(tmp_path):
    assert _mpirun(tmp_path, "fail", 3, {}, P2P) == [3, 3, 2]


def test_p2p_fail_from_another_thread(tmp_path):
    assert _mpirun(tmp_path, "fail_from_thread", 2, {}, P2P) == [1, 1]


def test_p2p_recv_takes_its_message_while_a_blocking_call_waits(tmp_path):
    assert _mpirun(tmp_path, "claimed_while_waiting", 2, {}, P2P) == [2, 2]


def test_probe_leaves_a_started_recvs_message_to_it(tmp_path):
    assert _mpirun(tmp_path, "probe_after_start", 2, {}, P2P) == [1, 0]


def test_p2p_many_in_flight_any_test_order(tmp_path):
    assert _mpirun(tmp_path, "stress", 3, {}, P2P) == [2, 2, 2]


def test_p2p_release_with_transfers_in_flight(tmp_path):
    assert _mpirun(tmp_path, "release", 2, {}, P2P) == [3, 3]
