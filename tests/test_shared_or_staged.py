"""The "shared_or_staged" rows (allreduce, allgather): single copy when every rank's buffers are
plait shared buffers, else the staged ring (allreduce; "staged_parts" from 256 KiB) or direct
(allgather), chosen alike on every rank. Exact results over private, shared and mixed buffers, in
and out of place, over several staging rounds; mapped_bytes says which branch ran; auto picks the
row where table.cc says."""

import os

import numpy as np
import pytest

import plait
from conftest import run_ranks

# 20_001 float32: the ring branch; 300_001: staged_parts, several rounds of an 8 KiB staging area
COUNTS = (1, 37, 20_001, 300_001)


def _x(rank, count, dtype):
    return ((np.arange(count, dtype=np.int64) % 1000 + 1) * (rank + 1)).astype(dtype)


def _sum(n, count, dtype):
    return ((np.arange(count, dtype=np.int64) % 1000 + 1) * (n * (n + 1) // 2)).astype(dtype)


def _buf(shape, dtype, shared):
    return plait.empty(shape, dtype) if shared else np.empty(shape, dtype)


def _cases(rank, n, store, staging):
    comm = plait.init(rank, n, store=store, timeout=60, buffer_bytes=staging)
    wrong, branch = [], {}
    with comm:
        if not comm.single_copy:
            return None
        for who in ("private", "shared", "mixed"):
            shared = who == "shared" or (who == "mixed" and rank == 0)
            for dtype in ("float32", "int32"):
                for count in COUNTS:
                    for in_place in (False, True):
                        label = "%s %s count=%d %s" % (who, dtype, count, "in place" if in_place else "out")
                        before = comm.mapped_bytes
                        x = _buf(count, dtype, shared)
                        x[...] = _x(rank, count, dtype)
                        out = x if in_place else _buf(count, dtype, shared)
                        got = comm.allreduce(x, out, algorithm="shared_or_staged")
                        if not np.array_equal(got, _sum(n, count, dtype)):
                            wrong.append("allreduce " + label)
                        og = _buf((n, count), dtype, shared)
                        if in_place:
                            og[rank] = _x(rank, count, dtype)
                            x = og[rank]
                        got = comm.allgather(x, og, algorithm="shared_or_staged")
                        want = np.stack([_x(r, count, dtype) for r in range(n)])
                        if not np.array_equal(got, want):
                            wrong.append("allgather " + label)
                        branch[label] = comm.mapped_bytes - before
        return wrong, branch


@pytest.mark.parametrize("n", (2, 3), ids=lambda n: "n%d" % n)
@pytest.mark.parametrize("staging", (8192, None), ids=("8KiB", "default"))
def test_exact_on_private_shared_and_mixed_buffers(n, staging):
    results = run_ranks(_cases, n, timeout=300, args=(staging,))
    if results[0] is None:
        pytest.skip("single copy unavailable here")
    for rank, (wrong, branch) in enumerate(results):
        assert not wrong, "rank %d: wrong results: %s" % (rank, wrong[:10])
        for label, moved in branch.items():
            # Only when every rank's buffers are shared does the call move bytes through mappings;
            # a mixed call stages on every rank (a rank that mapped its peer's buffer agreed).
            if label.startswith("shared"):
                assert moved > 0, "rank %d %s: single copy not taken (mapped_bytes +0)" % (rank, label)
            else:
                assert moved == 0, "rank %d %s: mapped_bytes +%d on a staged call" % (rank, label, moved)


def _auto(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=60)
    with comm:
        if not comm.single_copy:
            return None
        picks = {}
        for coll, nbytes in (
            ("allreduce", 2 << 20),
            ("allreduce", 128 << 10),
            ("allreduce", 4 << 20),
            ("allreduce", 8 << 20),
            ("allgather", 1 << 20),
        ):
            x = _x(rank, nbytes // 4, "float32")
            if coll == "allreduce":
                ok = np.array_equal(comm.allreduce(x), _sum(n, x.size, "float32"))
            else:
                ok = np.array_equal(comm.allgather(x), np.stack([_x(r, x.size, "float32") for r in range(n)]))
            picks["%s %d" % (coll, nbytes)] = (plait.dump(comm)["ranks"][rank]["calls"][-1]["algorithm"], ok)
        return picks


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="2 ranks on 1 core are oversubscribed: auto stages")
def test_auto_takes_it_in_the_middle_sizes_at_two_ranks():
    picks = run_ranks(_auto, 2, timeout=120)[0]
    if picks is None:
        pytest.skip("single copy unavailable here")
    assert picks == {
        "allreduce 2097152": ("shared_or_staged", True),
        "allreduce 131072": ("single_copy", True),
        "allreduce 4194304": ("shared_or_staged", True),
        "allreduce 8388608": ("single_copy", True),
        "allgather 1048576": ("shared_or_staged", True),
    }
