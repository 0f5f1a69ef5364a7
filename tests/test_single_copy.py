"""Single copy (process_vm_readv): availability agreed at init, the fallback when it is off,
and a clear error when it is forced but unavailable. The exact-result coverage of the
single_copy algorithms is in test_collectives.py (they are in every algorithm loop there)."""
import numpy as np
import pytest

import plait
from conftest import run_ranks

COUNT = 300_001  # above the 16 KiB / 2 MiB auto thresholds, several 1 MiB scratch chunks


def _expected(n):
    return sum(np.arange(COUNT, dtype=np.int64) * (r + 1) for r in range(n)).astype(np.int32)


def _on(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=30)
    with comm:
        avail, why = comm.single_copy, comm.single_copy_unavailable
        got = comm.allreduce(np.arange(COUNT, dtype=np.int32) * (rank + 1), algorithm="single_copy") \
            if avail else None
        return avail, why, None if got is None else bool((got == _expected(n)).all())


@pytest.mark.parametrize("n", (2, 3))
def test_single_copy_is_agreed_and_exact(n):
    results = run_ranks(_on, n, timeout=60)
    assert len({r[0] for r in results}) == 1, results  # every rank agrees
    avail, why, exact = results[0]
    if not avail:
        # A kernel that forbids cross-memory attach (ptrace scope, seccomp): say why, fall back.
        assert why, results
        pytest.skip("single copy unavailable here: " + why)
    assert why == "" and all(r[2] for r in results), results


def _off(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=30)
    with comm:
        assert not comm.single_copy
        assert "PLAIT_SINGLE_COPY=0" in comm.single_copy_unavailable
        x = np.arange(COUNT, dtype=np.int32) * (rank + 1)
        ok = bool((comm.allreduce(x) == _expected(n)).all())  # auto falls back to staging
        ag = comm.allgather(x)
        ok = ok and all((ag[r] == np.arange(COUNT, dtype=np.int32) * (r + 1)).all() for r in range(n))
        try:
            comm.allgather(x, algorithm="single_copy")
        except plait.InvalidArgument as e:
            return ok, str(e)
        return ok, None


def test_single_copy_off_falls_back_and_forcing_it_raises_everywhere():
    # One rank turning it off is enough: all ranks must agree, or a call would use it on some.
    results = run_ranks(_off, 3, timeout=60, env={"PLAIT_SINGLE_COPY": "0"})
    for rank, (ok, err) in enumerate(results):
        assert ok, rank
        assert err and "single_copy" in err and "not available" in err, (rank, err)


def _one_off(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=30)
    with comm:
        return comm.single_copy, comm.single_copy_unavailable


def test_one_rank_without_single_copy_turns_it_off_for_all(monkeypatch):
    import os
    def fn(rank, n, store):
        if rank == 1:
            os.environ["PLAIT_SINGLE_COPY"] = "0"
        return _one_off(rank, n, store)
    results = run_ranks(fn, 3, timeout=60)
    assert [r[0] for r in results] == [False] * 3, results
    assert "rank 1" in results[0][1] and "PLAIT_SINGLE_COPY=0" in results[1][1], results
