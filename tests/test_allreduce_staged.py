"""allreduce "staged_parts" (csrc/algo/allreduce_staged_parts.cc), alone and as the private-buffer
branch of "shared_or_staged" from 256 KiB: exact results for every dtype and op, in and out of
place, at counts that end a round early or split it unevenly (a shorter last round places its parts
where a peer may still read the round before: the case that once went wrong at 3 ranks), over
several staging sizes and world sizes 1-4 and 8 (oversubscribed here), identical bytes on every
rank."""

import os
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks
from test_collectives import PAIRS, data, dtype_kw, reduce_ref, storage


def _chunk(staging, n, esize):
    """Elements in one round: n parts of a quarter of the staging, rounded down to 64-byte lines
    (staging: the per-rank buffer; calls alternate halves, a half holds two slots)."""
    per = staging // 4 // n // esize
    line = max(1, 64 // esize)
    return (per - per % line if per >= line else per) * n


def _counts(staging, n, esize):
    c = _chunk(staging, n, esize)
    return sorted({0, 1, n - 1, n + 1, 37, c - 1, c, c + 1, 2 * c + n - 1, 3 * c + 1, 5 * c - 7})


def _cases(rank, n, store, staging):
    comm = plait.init(rank, n, store=store, timeout=120, buffer_bytes=staging)
    wrong, digests = [], []
    with comm:
        eff = max(8192, staging)  # plait's minimum; both sizes here are whole pages
        for i, (dt, op) in enumerate(PAIRS):
            esize = storage(dt).itemsize
            for count in _counts(eff, n, esize):
                inplace = (i + count) % 2 == 0
                x = data(rank, count, dt, op)
                want = reduce_ref([data(r, count, dt, op) for r in range(n)], dt, op)
                x0 = x.copy()
                out = x if inplace else np.full_like(x, 3)
                got = comm.allreduce(x, out, op=op, algorithm="staged_parts", **dtype_kw(dt))
                label = "%s %s count=%d %s" % (dt, op, count, "in place" if inplace else "out of place")
                if got is not out or not np.array_equal(got, want):
                    wrong.append(label)
                if not inplace and not np.array_equal(x, x0):
                    wrong.append(label + " (input changed)")
                digests.append(got.tobytes())
    return wrong, digests


@pytest.mark.parametrize("n", (1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)), ids=lambda n: "n%d" % n)
@pytest.mark.parametrize("staging", (8192, 24576), ids=("8KiB", "24KiB"))
def test_exact_every_dtype_and_op(n, staging):
    results = run_ranks(_cases, n, timeout=300, args=(staging,))
    for rank, (wrong, _) in enumerate(results):
        assert not wrong, "rank %d: wrong results: %s" % (rank, wrong[:10])
    assert all(res[1] == results[0][1] for res in results), "ranks got different bytes"


def _large(rank, n, store, staging, algo):
    """Counts of 256 KiB and more (where shared_or_staged stages through staged_parts), private
    buffers, int32 sums that wrap and float32 averages that are exact."""
    comm = plait.init(rank, n, store=store, timeout=120, buffer_bytes=staging)
    wrong = []
    with comm:
        for count in (65_536, 65_537, 300_001, 1 << 20):
            i = np.arange(count, dtype=np.int64)
            for dtype, op in (("int32", "sum"), ("float32", "avg")):
                x = (((i * 7 + rank * 13) % 1001) * (2**22 + 1 if dtype == "int32" else 4)).astype(dtype)
                full = [
                    (((i * 7 + r * 13) % 1001) * (2**22 + 1 if dtype == "int32" else 4)) for r in range(n)
                ]
                s = np.sum(full, axis=0)
                want = s.astype(np.int32) if dtype == "int32" else s.astype(np.float32) / np.float32(n)
                for inplace in (False, True):
                    y = x.copy()
                    got = comm.allreduce(y, y if inplace else None, op=op, algorithm=algo)
                    if not np.array_equal(got, want):
                        wrong.append("%s %s count=%d inplace=%s" % (dtype, op, count, inplace))
    return wrong


@pytest.mark.parametrize("algo", ("staged_parts", "shared_or_staged", "auto"))
@pytest.mark.parametrize("n", (2, 3), ids=lambda n: "n%d" % n)
def test_large_private_buffers(n, algo):
    for staging in (None, 8192):
        for rank, wrong in enumerate(run_ranks(_large, n, timeout=300, args=(staging, algo))):
            assert not wrong, "rank %d staging %s: %s" % (rank, staging, wrong[:10])


def _peer_dies(rank, n, store):
    """Rank 1 leaves after one call; rank 0's next staged_parts call (many rounds of an 8 KiB
    staging) must end in PeerLostError naming rank 1, not hang."""
    comm = plait.init(rank, n, store=store, timeout=30, buffer_bytes=8192)
    x = np.ones(100_003, np.float32)
    comm.allreduce(x, algorithm="staged_parts")
    if rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        comm.allreduce(x, algorithm="staged_parts")
    except plait.PeerLostError as e:
        return ("PeerLostError", str(e), time.monotonic() - t0)
    return ("no error", "", time.monotonic() - t0)


def test_peer_lost_mid_call():
    kind, msg, took = run_ranks(_peer_dies, 2, timeout=60, may_die=(1,))[0]
    assert kind == "PeerLostError", msg
    assert "rank 1" in msg and "allreduce" in msg, msg
    assert took < 10, "noticed after %.1f s" % took
