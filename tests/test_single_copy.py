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
        got = (
            comm.allreduce(np.arange(COUNT, dtype=np.int32) * (rank + 1), algorithm="single_copy")
            if avail
            else None
        )
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


def _auto_choices(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=30)
    with comm:
        if not comm.single_copy:
            return None
        picks = {}
        for coll, nbytes in (
            ("broadcast", 8 << 10),
            ("broadcast", 64 << 10),
            ("reduce", 8 << 10),
            ("reduce", 64 << 10),
            ("reduce", 64 << 20),
            ("alltoall", 1 << 20),
        ):
            x = np.full(nbytes // 4, rank + 1, np.int32)
            if coll == "broadcast":
                comm.broadcast(x, 0)
                ok = bool((x == 1).all())
            elif coll == "reduce":
                got = comm.reduce(x, 0)
                ok = rank != 0 or bool((got == n * (n + 1) // 2).all())
            else:
                got = comm.alltoall(x)
                ok = bool((got.reshape(n, -1) == np.arange(1, n + 1)[:, None]).all())
            last = plait.dump(comm)["ranks"][rank]["calls"][-1]
            picks[f"{coll} {nbytes}"] = (last["algorithm"], ok)
        return picks


def test_auto_picks_single_copy_for_rooted_calls_from_16_kib():
    # The measured table (csrc/algo/table.cc): broadcast and reduce take single copy from 16 KiB
    # (reduce below 64 MiB), alltoall stays staged; the flight recorder says what ran.
    picks = run_ranks(_auto_choices, 2, timeout=120)[0]
    if picks is None:
        pytest.skip("single copy unavailable here")
    assert picks == {
        "broadcast 8192": ("direct", True),
        "broadcast 65536": ("single_copy", True),
        "reduce 8192": ("direct", True),
        "reduce 65536": ("single_copy", True),
        "reduce 67108864": ("direct", True),
        "alltoall 1048576": ("direct", True),
    }, picks
