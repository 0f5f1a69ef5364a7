"""gather, scatter, allgatherv, alltoallv and the object collectives at 1-4 ranks: uneven counts
(0 included), every root, exact integer-valued data from closed formulas; arguments that disagree
across ranks raise the same error on every rank, and the communicator works on afterwards."""

import numpy as np
import pytest

import plait
from conftest import run_ranks


def _rows(src, dst, n, width=2):
    """Rows rank src sends rank dst: value 10000*src + 100*dst + i, then its negation."""
    v = 10000 * src + 100 * dst + np.arange(n, dtype=np.int64)
    return np.stack([v, -v], axis=1).reshape(n, width) if n else np.empty((0, width), np.int64)


def _send_counts(src, n):
    return [(src + 2 * dst) % 3 for dst in range(n)]


def _cases(comm):
    r, n, wrong = comm.rank, comm.size, []

    def check(name, got, want):
        if got is None or want is None:
            if got is not want:
                wrong.append(f"{name}: got {got!r}, want {want!r}")
        elif got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
            wrong.append(f"{name}: got {got!r}, want {want!r}")

    for root in range(n):
        x = (np.arange(6, dtype=np.int32) + 100 * r).reshape(2, 3)
        want = np.stack([(np.arange(6, dtype=np.int32) + 100 * i).reshape(2, 3) for i in range(n)])
        check(f"gather root {root}", comm.gather(x, root), want if r == root else None)
        empty = comm.gather(np.empty(0, np.float32), root)
        check(f"gather empty root {root}", empty, np.empty((n, 0), np.float32) if r == root else None)

        table = np.arange(n * 6, dtype=np.float64).reshape(n, 2, 3) + root
        got = comm.scatter(table if r == root else None, root)
        check(f"scatter root {root}", got, np.arange(n * 6, dtype=np.float64).reshape(n, 2, 3)[r] + root)
        flags = np.array([[i % 2 == 0, True] for i in range(n)])
        check(f"scatter bool root {root}", comm.scatter(flags if r == root else None, root), flags[r])

    patterns = {
        "0..n-1": list(range(n)),
        "even": [3] * n,
        "all zero": [0] * n,
        "last only": [0] * (n - 1) + [50],
    }
    for label, counts in patterns.items():
        for dtype in (np.float32, np.int64, np.uint8):
            x = (np.arange(counts[r] * 2) + 1000 * r).astype(dtype).reshape(counts[r], 2)
            want = np.concatenate(
                [(np.arange(c * 2) + 1000 * i).astype(dtype).reshape(c, 2) for i, c in enumerate(counts)]
            )
            check(f"allgatherv {label} {dtype.__name__}", comm.allgatherv(x), want)
            check(f"allgatherv {label} counts=", comm.allgatherv(x, counts=counts), want)

    send = _send_counts(r, n)
    x = np.concatenate([_rows(r, j, c) for j, c in enumerate(send)])
    want = np.concatenate([_rows(i, r, _send_counts(i, n)[r]) for i in range(n)])
    check("alltoallv", comm.alltoallv(x, send), want)
    recv = [_send_counts(i, n)[r] for i in range(n)]
    check("alltoallv recv_counts=", comm.alltoallv(x, send, recv), want)
    zeros = comm.alltoallv(np.empty((0, 2), np.int64), [0] * n)
    check("alltoallv all zero", zeros, np.empty((0, 2), np.int64))

    objs = comm.allgather_object({"rank": r, "text": "x" * (37 * r)})
    if objs != [{"rank": i, "text": "x" * (37 * i)} for i in range(n)]:
        wrong.append(f"allgather_object: {objs!r}")
    for root in range(n):
        got = comm.broadcast_object(("from", root, list(range(root))) if r == root else "ignored", root)
        if got != ("from", root, list(range(root))):
            wrong.append(f"broadcast_object root {root}: {got!r}")
    return wrong


def _errors(comm):
    """Each bad call raises the same class on every rank (returned per case), then a good call works."""
    r, n, seen = comm.rank, comm.size, {}

    def expect(name, fn):
        try:
            fn()
            seen[name] = "no error"
        except plait.PlaitError as e:
            seen[name] = type(e).__name__
            if name == "own count wrong" and r == 0 and "rank 0" not in str(e):
                seen[name] = f"message does not name the rank: {e}"

    one = np.ones((1, 2), np.int32)
    # rank 0 believes rank 1 sends 2 rows; rank 1 sends 1
    expect(
        "counts disagree", lambda: comm.allgatherv(one, counts=[1, 2] + [1] * (n - 2) if r == 0 else [1] * n)
    )
    expect("own count wrong", lambda: comm.allgatherv(one, counts=[5] * n if r == 0 else [1] * n))
    bad = [2] + [1] * (n - 1)  # every rank sends this one 1 row
    expect("recv_counts wrong", lambda: comm.alltoallv(np.ones((n, 2)), [1] * n, bad if r == n - 1 else None))
    neg = [-1] + [1] * (n - 1) if r == 1 else [0] * n
    expect("negative send count", lambda: comm.alltoallv(np.ones((0 if r != 1 else n - 2, 2)), neg))
    dt = np.float32 if r == 0 else np.float64
    expect("gather dtype disagrees", lambda: comm.gather(np.ones(3, dt), 0))
    expect("gather root disagrees", lambda: comm.gather(np.ones(3), r % 2))
    expect("scatter shape", lambda: comm.scatter(np.ones((n + 1, 2)) if r == 0 else None, 0))
    expect("bad root", lambda: comm.gather(np.ones(3), n))
    after = comm.allgatherv(np.full((r, 1), r, np.int16))
    ok = np.array_equal(after, np.concatenate([np.full((i, 1), i, np.int16) for i in range(n)]))
    return seen, ok


EXPECTED_ERRORS = {
    "counts disagree": "MismatchError",
    "own count wrong": "InvalidArgument",
    "recv_counts wrong": "MismatchError",
    "negative send count": "InvalidArgument",
    "gather dtype disagrees": "MismatchError",
    "gather root disagrees": "MismatchError",
    "scatter shape": "InvalidArgument",
    "bad root": "InvalidArgument",
}


def _worker(rank, n, addr):
    comm = plait.init(rank, n, store=addr, timeout=60)
    try:
        wrong = _cases(comm)
        errors = _errors(comm) if n >= 2 else None
        return wrong, errors
    finally:
        plait.finalize()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_uneven_and_object_collectives(n):
    for rank, (wrong, errors) in enumerate(run_ranks(_worker, n, timeout=240)):
        assert wrong == [], f"rank {rank}: {wrong}"
        if errors is None:
            continue
        seen, ok = errors
        assert ok, f"rank {rank}: allgatherv after the errors gave wrong data"
        assert seen == EXPECTED_ERRORS, f"rank {rank}"


def _facade(rank, n, addr):
    plait.init(rank, n, store=addr)
    try:
        return (
            plait.rank(),
            plait.size(),
            plait.local_rank(),
            plait.local_size(),
            plait.allgather_object(rank * 7),
            plait.broadcast_object("r0" if rank == 0 else None),
        )
    finally:
        plait.finalize()


def test_rank_size_and_module_functions():
    got = run_ranks(_facade, 3, timeout=120)
    assert got == [(r, 3, r, 3, [0, 7, 14], "r0") for r in range(3)]
    with pytest.raises(plait.PlaitError, match="not initialized"):
        plait.rank()


def _hier_worker(rank, n, addr, hosts):
    import os

    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    comm = plait.init(rank, n, store=addr, timeout=60)
    try:
        kind = type(comm).__name__
        return kind, _cases(comm), _errors(comm)
    finally:
        plait.finalize()


@pytest.mark.slow  # gloo between the simulated hosts
@pytest.mark.parametrize("hosts", [("a", "a", "b"), ("a", "b", "a", "b")])
def test_on_simulated_hosts(hosts):
    pytest.importorskip("torch")
    for rank, (kind, wrong, (seen, ok)) in enumerate(run_ranks(_hier_worker, len(hosts), 300, (hosts,))):
        assert kind == "HierCommunicator"
        assert wrong == [], f"rank {rank}: {wrong}"
        assert ok and seen == EXPECTED_ERRORS, (rank, seen)
