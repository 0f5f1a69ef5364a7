"""What one rank runs under mpirun for tests/test_mpi_engine.py: plait._mpi's engine driven
through EngineForTests on numpy arrays, every result compared exactly with a closed form.

Run as `python mpi_engine_checks.py CASE OUTDIR`; writes OUTDIR/CASE-<rank> with "ok <checks>"
or the exception, so the test reads every rank's outcome (mpirun interleaves stdout).
"""

import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
from mpi4py import MPI

import plait
from plait import _mpi

DTYPES = ["float32", "float64", "int8", "uint8", "int32", "int64", "bool"]
OPS = ["sum", "prod", "min", "max"]
INVALID, MISMATCH, PEER_LOST = 2, 3, 5  # capi.h's PLAIT_E_*


def member_data(dtype, op, count, r):
    """Rank r's allreduce input: small integers, so even an int8 product over 3 ranks is exact."""
    i = np.arange(count)
    if dtype == "bool":
        return (i + r) % 3 == 0
    if op == "prod":
        v = 1 + (i + r) % 2  # 1 or 2
    elif dtype == "uint8":
        v = (i * 7 + r * 5) % 40
    else:
        v = (i * 7 + r * 5) % 40 - 20  # negatives too
    return v.astype(dtype)


def expected_reduction(dtype, op, count, size):
    """Closed form of the op over every member's member_data (numpy's own, exact on integers)."""
    parts = np.stack([member_data(dtype, op, count, r) for r in range(size)])
    if dtype == "bool":
        return parts.any(0) if op in ("sum", "max") else parts.all(0)
    f = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
    return f(parts, axis=0).astype(dtype)


def block(dtype, r, j, count):
    """Member r's block j (alltoall) or its only block (j = 0), distinct per (r, j, element)."""
    v = (np.arange(count) + 11 * r + 5 * j) % 100
    return (v % 2 == 1) if dtype == "bool" else v.astype(dtype)


def exact(eng):
    r, n, checks = eng.rank, eng.size, 0
    for dtype in DTYPES + ["float16", "bfloat16"]:
        for op in OPS + ["avg"]:
            assert eng.supports(dtype, op) == (dtype in DTYPES and op != "avg"), (dtype, op)
            checks += 1
    for count in (0, 1, 7, 3001):
        for dtype in DTYPES:
            for op in OPS:
                a = member_data(dtype, op, count, r)
                eng.allreduce(a, op)
                want = expected_reduction(dtype, op, count, n)
                assert a.dtype == want.dtype and np.array_equal(a, want), (dtype, op, count, a[:8], want[:8])
                checks += 1
            # allreduce_start: every op of this dtype in flight at once, then waited in turn
            started = [(op, member_data(dtype, op, count, r)) for op in OPS]
            reqs = [eng.allreduce_start(a, op) for op, a in started]
            for req, (op, a) in zip(reqs, started):
                eng.wait(req)
                want = expected_reduction(dtype, op, count, n)
                assert np.array_equal(a, want), ("allreduce_start", dtype, op, count, a[:8], want[:8])
            checks += 1
            mine = block(dtype, r, 0, count)
            out = np.zeros(n * count, dtype=mine.dtype)
            eng.allgather(mine, out)
            want = np.concatenate([block(dtype, m, 0, count) for m in range(n)])
            assert np.array_equal(out, want), ("allgather", dtype, count)
            out2 = np.zeros_like(out)
            req = eng.allgather_start(mine, out2)
            eng.wait(req)
            assert np.array_equal(out2, want), ("allgather_start", dtype, count)
            for root in range(n):
                a = block(dtype, r, 0, count) if r == root else np.zeros(count, dtype=mine.dtype)
                eng.broadcast(a, root)
                assert np.array_equal(a, block(dtype, root, 0, count)), ("broadcast", root, dtype, count)
            ins = np.concatenate([block(dtype, r, j, count) for j in range(n)])
            out = np.zeros_like(ins)
            eng.alltoall(ins, out)
            want = np.concatenate([block(dtype, m, r, count) for m in range(n)])
            assert np.array_equal(out, want), ("alltoall", dtype, count)
            checks += 3 + n
        checks += point_to_point(eng, count)
    return checks + wrong_input(eng)


def point_to_point(eng, count):
    """A ring, even ranks sending first (a large send waits for its receive), then two tags
    received in the opposite order of their sends."""
    r, n = eng.rank, eng.size
    right, left = (r + 1) % n, (r - 1) % n
    mine, got = block("int64", r, 1, count), np.full(count, -1, dtype=np.int64)
    if r % 2 == 0:
        eng.send(mine, right, 3)
        eng.recv(got, left, 3)
    else:
        eng.recv(got, left, 3)
        eng.send(mine, right, 3)
    assert np.array_equal(got, block("int64", left, 1, count)), ("ring", count)
    if count <= 7 and n > 1:  # small: the sends complete before their receives are posted
        if r == 0:
            eng.send(np.full(count, 5, dtype=np.int32), 1, 5)
            eng.send(np.full(count, 6, dtype=np.int32), 1, 6)
        elif r == 1:
            six, five = np.zeros(count, dtype=np.int32), np.zeros(count, dtype=np.int32)
            eng.recv(six, 0, 6)
            eng.recv(five, 0, 5)
            assert (six == 6).all() and (five == 5).all(), (six, five)
    return 2


def wrong_input(eng):
    r, n, checks = eng.rank, eng.size, 0
    for call in (
        lambda: eng.allreduce(np.ones(3, dtype=np.float16), "sum"),
        lambda: eng.send(np.ones(1), r, 0),
        lambda: eng.recv(np.ones(1), n, 0),
        lambda: eng.send(np.ones(1), (r + 1) % n, -1),
        lambda: eng.broadcast(np.ones(1), n),
    ):
        try:
            call()
        except plait.InvalidArgument as e:
            assert "mpi engine group test" in str(e) and f"rank {r} of {n}" in str(e), e
            checks += 1
        else:
            raise AssertionError("no InvalidArgument")
    # A message longer or shorter than the receive: MismatchError naming the peer and the tag.
    if r == 0:
        eng.send(np.arange(4, dtype=np.int32), 1, 9)
        eng.send(np.arange(2, dtype=np.int32), 1, 9)
    elif r == 1:
        for want_bytes, what in ((8, "the message had 16 bytes"), (16, "the message had 8 bytes")):
            try:
                eng.recv(np.zeros(want_bytes // 4, dtype=np.int32), 0, 9, timeout=30)
            except plait.MismatchError as e:
                assert f"recv of {want_bytes} bytes from peer 0 tag 9" in str(e) and what in str(e), e
                checks += 1
            else:
                raise AssertionError("no MismatchError")
    eng.allreduce(np.zeros(1, dtype=np.int32), "sum")  # still usable afterwards
    return checks


def timeout(eng):
    """A receive nobody sends and a collective one member joins late: TimeoutError near the
    deadline; the cancelled receive leaves the group usable, the stranded collective does not."""
    r, n, last = eng.rank, eng.size, eng.size - 1
    if r == 0:
        t0 = time.monotonic()
        try:
            eng.recv(np.zeros(4, dtype=np.int32), 1, 7, timeout=0.4)
        except plait.TimeoutError as e:
            took = time.monotonic() - t0
            assert 0.35 < took < 3 and "recv of 16 bytes from peer 1 tag 7" in str(e), (took, e)
        else:
            raise AssertionError("no TimeoutError")
    a = np.full(5, r + 1, dtype=np.int64)
    eng.allreduce(a, "sum")  # the cancelled recv left nothing behind
    assert (a == n * (n + 1) // 2).all(), a
    if r == last:
        time.sleep(1.5)
        a = np.ones(3, dtype=np.int32)
        eng.allreduce(a, "sum", timeout=60)  # completes: the others keep MPI progressing below
        assert (a == n).all(), a
    else:
        t0 = time.monotonic()
        try:
            eng.allreduce(np.ones(3, dtype=np.int32), "sum", timeout=0.3)
        except plait.TimeoutError as e:
            assert time.monotonic() - t0 < 1.2 and "allreduce of 3 int32 (sum)" in str(e), e
        else:
            raise AssertionError("no TimeoutError")
        try:
            eng.broadcast(np.ones(1), 0)
        except plait.PeerLostError as e:
            assert "out of step" in str(e) and "allreduce of 3 int32" in str(e), e
        else:
            raise AssertionError("a group with a stranded collective took another call")
    MPI.COMM_WORLD.Barrier()  # progresses the stranded allreduce until the late member joins
    return 4 + part_way(r)


def part_way(r):
    """A receive of 4 pieces whose message brought 2: the timeout cancels the rest, and the
    pair's later messages would be out of step, so the group refuses further calls."""
    small = _mpi.EngineForTests(_mpi.make_engine(MPI.COMM_WORLD, "pieces", 8))
    checks = 0
    if r == 0:
        small.send(np.arange(4, dtype=np.int32), 1, 2)  # 16 bytes: two 8-byte pieces
    elif r == 1:
        got = np.zeros(8, dtype=np.int32)
        try:
            small.recv(got, 0, 2, timeout=0.3)
        except plait.TimeoutError:
            assert (got[:4] == np.arange(4)).all(), got
            checks += 1
        try:
            small.recv(np.zeros(1, dtype=np.int32), 0, 3)
        except plait.PeerLostError as e:
            assert "gave up part way" in str(e) and "recv of 32 bytes from peer 0 tag 2" in str(e), e
            checks += 1
    small.close()
    return checks


def fail(eng, kind=None, error=None):
    """One member fails while the others wait in an allreduce: the same error everywhere soon,
    of the kind fail() was given (PEER_LOST unless told)."""
    kind, error = kind or PEER_LOST, error or plait.PeerLostError
    r, n, culprit = eng.rank, eng.size, eng.size - 1
    if r == culprit:
        time.sleep(0.3)
        eng.fail(kind, "boom (a test)")
    t0 = time.monotonic()
    try:
        eng.allreduce(np.ones(2, dtype=np.float64), "sum", timeout=60)
    except error as e:
        took = time.monotonic() - t0
        assert type(e) is error and str(e) == f"rank {culprit} failed: boom (a test)", e
        assert took < (0.1 if r == culprit else 1.5), took
    else:
        raise AssertionError(f"no {error.__name__}")
    try:  # later calls fail at once; a later failure does not replace the first
        eng.fail(PEER_LOST, "second")
        eng.send(np.ones(1), (r + 1) % n, 0)
    except error as e:
        assert "boom" in str(e), e
    else:
        raise AssertionError(f"no {error.__name__}")
    MPI.COMM_WORLD.Barrier()
    return 2


def fail_mismatch(eng):
    return fail(eng, MISMATCH, plait.MismatchError)


def fail_invalid(eng):
    """A wrong argument on one rank: InvalidArgument on every rank (engine.h's flag-kind rule)."""
    return fail(eng, INVALID, plait.InvalidArgument)


def fail_from_thread(eng):
    """fail() from another thread while this rank's own call waits: that call and the others'
    end soon (the engine contract lets any thread call fail at any time)."""
    r = eng.rank
    t0 = time.monotonic()
    if r == 0:
        threading.Timer(0.3, eng.fail, (PEER_LOST, "from a thread")).start()

        def call():
            eng.recv(np.zeros(2, dtype=np.int64), 1, 4, timeout=60)  # rank 1 never sends
    else:

        def call():
            z = np.zeros(eng.size, dtype=np.int64)
            eng.alltoall(z, np.zeros_like(z))  # rank 0 never joins

    try:
        call()
    except plait.PeerLostError as e:
        took = time.monotonic() - t0
        assert str(e) == "rank 0 failed: from a thread", e
        assert took < (1.0 if r == 0 else 2.0), took
    else:
        raise AssertionError("no PeerLostError")
    MPI.COMM_WORLD.Barrier()
    return 1


def killed(eng):
    """Rank 1 is killed with SIGKILL while rank 0 waits in an allreduce: mpirun ends the job (its
    default on a rank's death), so rank 0 never returns from the call, nor hangs."""
    a = np.ones(1)
    eng.allreduce(a, "sum")
    if eng.rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    eng.allreduce(a, "sum", timeout=120)
    return 1


def fail_across_groups(eng):
    """The flag is job-wide: rank 2 fails on its own one-member group, and ranks 0 and 1, waiting
    in their pair group (rank 2 is not in it), hear of it through the world group's engine."""
    r = eng.rank
    sub = MPI.COMM_WORLD.Split(0 if r < 2 else 1, r)
    pair = _mpi.EngineForTests(_mpi.make_engine(sub, "pair"))
    sub.Free()
    calls = [lambda: eng.allreduce(np.ones(1), "sum")]  # then every group refuses at once
    if r == 2:
        time.sleep(0.3)
        pair.fail(PEER_LOST, "on my own group")
    else:  # waits in the pair group for a message the partner never sends
        calls.insert(0, lambda: pair.recv(np.zeros(1, dtype=np.int32), 1 - r, 8, timeout=60))
    t0 = time.monotonic()
    for call in calls:
        try:
            call()
        except plait.PeerLostError as e:
            assert str(e) == "rank 2 failed: on my own group", e
            assert time.monotonic() - t0 < 2.0, time.monotonic() - t0
        else:
            raise AssertionError("no PeerLostError")
    pair.close()
    MPI.COMM_WORLD.Barrier()
    return 1


def probe(eng):
    """probe(tag): nothing before anyone sent; then each sender's message of the tag (its source,
    its size, or None where the piece size hides it), received by name from the source found;
    other tags unseen; a bad tag refused."""
    r, n = eng.rank, eng.size
    chunk = int(os.environ.get("PLAIT_MPI_CHUNK_BYTES") or 1 << 30)
    assert eng.probe(4) == (-1, 0), eng.probe(4)
    MPI.COMM_WORLD.Barrier()
    checks = 1
    if r:
        eng.send(np.full(2, r, dtype=np.int64), 0, 4)
        eng.send(np.zeros(0, dtype=np.int64), 0, 5)
        eng.send(np.arange(250, dtype=np.int32) + 1000 * r, 0, 6)  # 1000 bytes
    else:
        for tag, nbytes in ((4, 16), (5, 0), (6, 1000)):
            seen = []
            for _ in range(n - 1):
                deadline = time.monotonic() + 30
                while (got := eng.probe(tag))[0] < 0:
                    assert eng.probe(9) == (-1, 0)  # no message has that tag
                    assert time.monotonic() < deadline, f"nothing of tag {tag}"
                src, size = got
                assert size == (nbytes if nbytes < chunk else None), (tag, got, chunk)
                out = np.zeros(nbytes // 8, np.int64) if tag != 6 else np.zeros(250, np.int32)
                eng.recv(out, src, tag)
                want = np.full(2, src) if tag == 4 else np.arange(250) + 1000 * src if tag == 6 else []
                assert out.tolist() == list(want), (tag, src, out[:4])
                seen.append(src)
                checks += 1
            assert sorted(seen) == list(range(1, n)), seen
        try:
            eng.probe(-1)
            raise AssertionError("tag -1 was taken")
        except plait.InvalidArgument as e:
            assert "tags go from 0" in str(e), e
            checks += 1
    MPI.COMM_WORLD.Barrier()
    return checks


def refusals():
    """make_engine's refusals, raised before anything collective (every rank makes them)."""
    checks = 0
    for comm, why in (
        (MPI.COMM_NULL, "intracommunicator"),
        (7, "intracommunicator"),
    ):
        try:
            _mpi.make_engine(comm, "bad")
        except plait.InvalidArgument as e:
            assert why in str(e), e
            checks += 1
    os.environ["PLAIT_MPI_CHUNK_BYTES"], old = "-3", os.environ.get("PLAIT_MPI_CHUNK_BYTES")
    try:
        _mpi.make_engine(MPI.COMM_WORLD, "bad")
    except plait.InvalidArgument as e:
        assert "PLAIT_MPI_CHUNK_BYTES=-3" in str(e), e
        checks += 1
    finally:
        if old is None:
            del os.environ["PLAIT_MPI_CHUNK_BYTES"]
        else:
            os.environ["PLAIT_MPI_CHUNK_BYTES"] = old
    assert checks == 3, checks
    return checks


def main():
    case, outdir = sys.argv[1], sys.argv[2]
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        assert _mpi.mpi_library() == MPI.Get_library_version()
        refusals()
        eng = _mpi.EngineForTests(_mpi.make_engine(MPI.COMM_WORLD, "test"))
        assert eng.name == "mpi" and (eng.rank, eng.size) == (rank, MPI.COMM_WORLD.Get_size())
        got = f"ok {globals()[case](eng)}"
        eng.close()
    except BaseException:  # noqa: BLE001 - reported through the file
        got = traceback.format_exc()
    with open(os.path.join(outdir, f"{case}-{rank}"), "w") as f:
        f.write(got)


if __name__ == "__main__":
    main()
