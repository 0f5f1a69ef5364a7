"""The uniform layout's large allreduce in pieces (csrc/hier/hier_colls.cc allreduce_pieces).

Simulated hosts (PLAIT_HOST_ID per rank), gloo between them. PLAIT_HIER_PIECE_BYTES=4096 (the
smallest piece) makes small counts run many pieces, so one piece, several pieces, a remainder
modulo the ranks per host and a last short piece are all exercised on exact integer data from
hier_checks.py; the same calls with pieces off (PLAIT_HIER_PIECE_BYTES=0: one engine call) give
the same bytes. Piece sizes that differ across hosts are a MismatchError on every rank before any
payload reaches the engine. A rank killed while pieces are in flight is a PeerLostError on every
other rank within seconds.
"""

import os
import signal
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks
from plait import _C

import hier_checks as hc

torch = pytest.importorskip("torch")
import torch.distributed  # noqa: E402,F401,F811 - imported once in the parent, inherited by the forks

LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "2x3": ["a", "a", "a", "b", "b", "b"],
    "3x1": ["a", "b", "c"],
    "2x2-interleaved": ["a", "b", "a", "b"],
}
PIECE = 4096
ROOM = _C.HIER_ROOM  # bytes of payload the call's frame carries (hier_comm.h kRoom)


def _counts(es, per_host):
    """Counts past the frame's room: one piece, exactly k pieces, pieces plus a short last one."""
    pe = max(per_host, PIECE // es // per_host * per_host)  # elements of one piece
    return sorted({ROOM // es + 1, pe - 1, pe, pe + 1, 3 * pe, 3 * pe + per_host + 1, 5 * pe - 7})


def _pieces(rank, n, addr, hosts, piece_bytes):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    os.environ["PLAIT_HIER_PIECE_BYTES"] = str(piece_bytes)
    comm = plait.init(timeout=60, buffer_bytes=8192)  # small staging: local steps multi-chunk too
    assert isinstance(comm, plait.HierCommunicator) and comm.engine == "gloo", repr(comm)
    per_host = hosts.count(hosts[rank])
    checks, sums = 0, []
    for dt in ("int32", "int8", "int64", "bool"):
        es = np.dtype(hc.np_dtype(dt)).itemsize
        for count in _counts(es, per_host):
            checks += hc.reductions(comm, count, dtypes=[dt], ops=["sum", "max"])
            sums.append(comm.allreduce(hc.data(rank, count, dt), op="sum").tobytes())
    for count in _counts(2, per_host)[-2:]:  # integer-valued halves: avg and prod stay exact
        checks += hc.reductions(comm, count, dtypes=["float16", "bfloat16"], ops=["avg", "prod"])
    checks += hc.asynchronous(comm)
    big = hc.data(rank, 3 * PIECE + 5, "int32")
    hs = [comm.allreduce(big + i, async_op=True) for i in range(3)]  # pipelined calls queued
    for i, h in enumerate(hs):
        want = hc.expected(n, big.size, "int32", "sum") + np.int32(n * i)
        hc._same(h.wait(timeout=60), want, f"rank {rank}: queued async allreduce {i}")
    comm.finalize()
    return checks, sums


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pieces_are_exact_and_match_one_piece(layout):
    hosts = LAYOUTS[layout]
    piped = run_ranks(_pieces, len(hosts), timeout=240, args=(hosts, PIECE))
    whole = run_ranks(_pieces, len(hosts), timeout=240, args=(hosts, 0))
    for r, ((checks, sums), (checks0, sums0)) in enumerate(zip(piped, whole)):
        assert checks == checks0 and checks > 150, (r, checks, checks0)
        assert sums == sums0, r  # the same bytes as one engine call


def _uneven_pieces(rank, n, addr, hosts):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    os.environ["PLAIT_HIER_PIECE_BYTES"] = str(PIECE if hosts[rank] == "a" else 8 * PIECE)
    comm = plait.init(timeout=30)
    small = comm.allreduce(np.ones(8, dtype=np.int32))  # in the frame: no pieces, no mismatch
    try:
        comm.allreduce(np.ones(4 * PIECE, dtype=np.int32))
        got = "no error"
    except plait.PlaitError as e:
        got = (type(e).__name__, str(e))
    comm.finalize()
    return small.tolist(), got


def test_piece_sizes_that_differ_across_hosts_are_a_mismatch_everywhere():
    hosts = LAYOUTS["2x2"]
    for r, (small, got) in enumerate(run_ranks(_uneven_pieces, 4, timeout=90, args=(hosts,))):
        assert small == [4] * 8, (r, small)
        assert got[0] == "MismatchError" and got[1].startswith(f"rank {r}: "), (r, got)


def _killed(rank, n, addr, hosts, victim):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    os.environ["PLAIT_HIER_PIECE_BYTES"] = str(PIECE)
    comm = plait.init(timeout=60)
    x = np.ones(5 * PIECE // 4 + 3, dtype=np.int32)  # 6 pieces: engine steps always in flight
    for i in range(1000000):
        if rank == victim and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            got = comm.allreduce(x, async_op=i % 2 == 1)
            got = got.wait() if i % 2 == 1 else got
            assert (got == n).all(), (rank, i)
        except plait.PlaitError as e:
            return type(e).__name__, time.monotonic(), str(e)
    return "no error", time.monotonic(), ""


@pytest.mark.parametrize("victim", [0, 3])
def test_rank_killed_during_pieces_is_peer_lost_everywhere(victim):
    start = time.monotonic()
    hosts = LAYOUTS["2x2"]
    res = run_ranks(_killed, 4, timeout=90, args=(hosts, victim), may_die=(victim,))
    for r, got in enumerate(res):
        if r == victim:
            assert got is None
            continue
        kind, when, msg = got
        # never the 60 s deadline: the segment or the engine sees the death mid-pipeline
        assert kind == "PeerLostError" and when - start < 25, (r, kind, when - start, msg)
