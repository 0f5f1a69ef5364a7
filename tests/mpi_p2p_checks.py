"""What one rank runs under mpirun for tests/test_mpi_engine.py's p2p_start/p2p_test tests: the
MPI engine's nonblocking point to point, several transfers in flight, on exact integer data.

Run as `python mpi_p2p_checks.py CASE OUTDIR`; writes OUTDIR/CASE-<rank> with "ok <checks>" or
the exception (mpirun interleaves stdout).
"""

import os
import sys
import threading
import time
import traceback

import numpy as np
from mpi4py import MPI

import plait
from plait import _mpi

MISMATCH, PEER_LOST = 3, 5  # capi.h's PLAIT_E_*
BIG = 1 << 17  # int64 elements: a 1 MiB message, past every eager size (a rendezvous)


def small_chunks():
    return bool(os.environ.get("PLAIT_MPI_CHUNK_BYTES"))


def counts():
    """0 (one empty message), 1, 7, 3001 and, in whole pieces only, 1 MiB."""
    return (0, 1, 7, 3001) + (() if small_chunks() else (BIG,))


def payload(src, dst, tag, count):
    """What src sends dst with tag: distinct per element, sender, receiver and tag."""
    return (np.arange(count, dtype=np.int64) * 7 + 100_000 * src + 1000 * dst + tag) % (1 << 31)


def finish(eng, reqs, timeout=60):
    """Tests every request, round after round, until each said done; errors propagate."""
    deadline = time.monotonic() + timeout
    while reqs:
        reqs = [q for q in reqs if not eng.p2p_test(q)]
        assert time.monotonic() < deadline, f"{len(reqs)} requests still running"


def exchange(eng, count=5, tag=3):
    """Two members each start a recv from the other, then send it with the blocking call, then
    finish the recv (the exchange a blocking recv would deadlock); then the mirror: a started
    send met by a blocking recv."""
    r = eng.rank
    peer = 1 - r
    got = np.full(count, -1, dtype=np.int64)
    q = eng.p2p_start(False, got, peer, tag)
    eng.send(payload(r, peer, tag, count), peer, tag)
    finish(eng, [q])
    assert np.array_equal(got, payload(peer, r, tag, count)), ("exchange", count, got[:4])
    mine, got = payload(r, peer, tag + 1, count), np.full(count, -1, dtype=np.int64)
    q = eng.p2p_start(True, mine, peer, tag + 1)
    eng.recv(got, peer, tag + 1)
    finish(eng, [q])
    assert np.array_equal(got, payload(peer, r, tag + 1, count)), ("mirror", count, got[:4])
    return 2


def exchange_all(eng):
    return sum(exchange(eng, count) for count in counts()) + refused(eng)


def refused(eng):
    """Bad peers and tags: InvalidArgument at start, naming the call, and no request."""
    r, n, checks = eng.rank, eng.size, 0
    a = np.zeros(2, dtype=np.int64)
    for send, peer, tag, why in (
        (True, r, 0, "the peer must be another member"),
        (False, n, 0, "the peer must be another member"),
        (False, 1 - r, -1, "tags go from 0"),
    ):
        try:
            eng.p2p_start(send, a, peer, tag)
        except plait.InvalidArgument as e:
            what = (
                f"{'send' if send else 'recv'} of 16 bytes {'to' if send else 'from'} peer {peer} tag {tag}"
            )
            assert why in str(e) and what in str(e) and f"rank {r} of {n}" in str(e), e
            checks += 1
        else:
            raise AssertionError("no InvalidArgument")
    return checks


def ring(eng):
    """Every member starts a recv from each neighbour and a send to each, all before any test:
    nothing waits on anything."""
    r, n, checks = eng.rank, eng.size, 0
    right, left = (r + 1) % n, (r - 1) % n
    for count in counts():
        from_left, from_right = (np.full(count, -1, dtype=np.int64) for _ in range(2))
        to_right, to_left = payload(r, right, 1, count), payload(r, left, 2, count)
        reqs = [
            eng.p2p_start(False, from_left, left, 1),
            eng.p2p_start(False, from_right, right, 2),
            eng.p2p_start(True, to_right, right, 1),
            eng.p2p_start(True, to_left, left, 2),
        ]
        finish(eng, reqs[::-1])
        assert np.array_equal(from_left, payload(left, r, 1, count)), ("from left", count)
        assert np.array_equal(from_right, payload(right, r, 2, count)), ("from right", count)
        checks += 1
    return checks


def in_order(eng):
    """50 messages on one (peer, tag), large (a rendezvous) and small (eager) mixed, started back
    to back and tested last first: the last reports done only once every earlier one finished,
    and the earlier ones then report done at their first test."""
    r, peer, checks = eng.rank, 1 - eng.rank, 0
    sizes = [8192 if i % 3 == 0 else i % 5 for i in range(50)]
    if r == 0:
        bufs = [payload(r, peer, i, size) for i, size in enumerate(sizes)]
    else:
        bufs = [np.full(size, -1, dtype=np.int64) for size in sizes]
    reqs = [eng.p2p_start(r == 0, b, peer, 4) for b in bufs]
    finish(eng, reqs[-1:])
    if r == 1:
        for i, b in enumerate(bufs):
            assert np.array_equal(b, payload(peer, r, i, sizes[i])), ("in order", i, b[:4])
    checks += 1
    for q in reqs[:-1]:
        assert eng.p2p_test(q), "an earlier request was not finished when a later one was"
        checks += 1
    return checks


def expect(eng, error, q, *texts, within=30):
    """Tests q until done; it must raise error with texts in its message within `within` s."""
    t0 = time.monotonic()
    try:
        finish(eng, [q], timeout=within + 30)
    except error as e:
        took = time.monotonic() - t0
        assert all(t in str(e) for t in texts) and took < within, (took, str(e), texts)
        return 1
    raise AssertionError(f"no {error.__name__}")


def mismatch(eng):
    """A recv meets a longer and a shorter message: MismatchError with the message's size, and
    the pair stays in step; a longer one of 1 MiB into 32 KiB too, started and blocking (it is
    received aside, never truncated: Open MPI 4.1 would write past the buffer). With 8-byte
    pieces, a message short of the pieces asked ends the recv when its last piece lands, not at
    the deadline; a longer one of whole pieces may have more behind it, so that group refuses
    further calls."""
    r, checks = eng.rank, 0
    small = _mpi.EngineForTests(_mpi.make_engine(MPI.COMM_WORLD, "pieces", 8))
    spoilt = _mpi.EngineForTests(_mpi.make_engine(MPI.COMM_WORLD, "spoilt", 8))
    if r == 0:  # 32 bytes (4 pieces) into a recv of 12 (8 + 4): pieces 2 and 3 are left over
        finish(spoilt, [spoilt.p2p_start(True, mine := np.arange(8, dtype=np.int32), 1, 1)])
        assert mine.size == 8
        eng.send(np.arange(16, dtype=np.int32), 1, 9)
        eng.send(np.arange(4, dtype=np.int32), 1, 9)
        small.send(np.arange(3, dtype=np.int32), 1, 2)  # 12 bytes: pieces of 8 and 4
        eng.send(payload(0, 1, 10, BIG), 1, 10)
        eng.send(payload(0, 1, 11, BIG), 1, 11)
    else:
        got = np.zeros(3, dtype=np.int32)
        q = spoilt.p2p_start(False, got, 0, 1)
        checks += expect(spoilt, plait.MismatchError, q, "recv of 12 bytes", "had at least 16 bytes")
        try:
            spoilt.recv(got, 0, 1)
        except plait.PeerLostError as e:
            assert "out of step" in str(e) and "recv of 12 bytes from peer 0 tag 1" in str(e), e
            checks += 1
        for nbytes in (64, 16):
            got = np.zeros(8, dtype=np.int32)  # the engine's until the request is done
            q = eng.p2p_start(False, got, 0, 9)
            checks += expect(
                eng, plait.MismatchError, q, "recv of 32 bytes from peer 0 tag 9", f"had {nbytes} bytes"
            )
        got = np.full(8, -1, dtype=np.int32)
        q = small.p2p_start(False, got, 0, 2, timeout=60)
        checks += expect(
            small, plait.MismatchError, q, "recv of 32 bytes from peer 0 tag 2", "had 12 bytes", within=10
        )
        assert got[:3].tolist() == [0, 1, 2] and (got[3:] == -1).all(), got
        fence = np.full(1 << 13, -1, dtype=np.int64)  # 32 KiB asked, 32 KiB more right after
        q = eng.p2p_start(False, part := fence[: 1 << 12], 0, 10)
        checks += expect(eng, plait.MismatchError, q, "recv of 32768 bytes", "had 1048576 bytes")
        assert part.base is fence and (fence[1 << 12 :] == -1).all(), "written past the buffer"
        try:
            eng.recv(fence[: 1 << 12], 0, 11)
        except plait.MismatchError as e:
            assert "recv of 32768 bytes from peer 0 tag 11" in str(e) and "had 1048576 bytes" in str(e), e
            assert (fence[1 << 12 :] == -1).all(), "written past the buffer"
            checks += 1
    spoilt.close()
    checks += exchange(eng) + exchange(small)  # both groups still usable
    small.close()
    return checks


def timeout(eng):
    """A recv nobody sends: TimeoutError at its deadline, cancelled cleanly (the group goes on).
    A 1 MiB send nobody receives: TimeoutError too; Open MPI cancels no send, so it stays with
    MPI and the group refuses further calls (its pair may be out of step)."""
    r, checks = eng.rank, 0
    if r == 0:
        got = np.zeros(4, dtype=np.int32)
        q = eng.p2p_start(False, got, 1, 7, timeout=0.4)
        t0 = time.monotonic()
        checks += expect(
            eng, plait.TimeoutError, q, "recv of 16 bytes from peer 1 tag 7", "deadline (0.4 s)", within=3
        )
        assert time.monotonic() - t0 > 0.3
    checks += exchange(eng)
    if r == 0:
        mine = payload(0, 1, 8, BIG)  # Open MPI keeps it after the timeout: it must outlive MPI's use
        q = eng.p2p_start(True, mine, 1, 8, timeout=0.3)
        checks += expect(eng, plait.TimeoutError, q, "send of 1048576 bytes to peer 1 tag 8", within=3)
        try:
            eng.p2p_start(False, np.zeros(1), 1, 3)
        except plait.PeerLostError as e:
            assert "Open MPI" in MPI.Get_library_version() and "gave up part way" in str(e), e
        else:
            assert "Open MPI" not in MPI.Get_library_version(), "the group took a call"
        checks += 1
    MPI.COMM_WORLD.Barrier()
    return checks


def fail(eng):
    """fail(MISMATCH) on the last rank while every rank has transfers in flight (to and from it,
    nobody sending): MismatchError with fail()'s message everywhere, within ~1 s."""
    r, culprit = eng.rank, eng.size - 1
    if r == culprit:
        got = np.zeros(2, dtype=np.int64)
        q = eng.p2p_start(False, got, 0, 5)
        time.sleep(0.3)
        eng.fail(MISMATCH, "boom (a test)")
        checks = expect(eng, plait.MismatchError, q, "rank 2 failed: boom (a test)", within=0.1)
    else:
        got, mine = np.zeros(2, dtype=np.int64), payload(r, culprit, 6, BIG)
        qs = [eng.p2p_start(False, got, culprit, 5), eng.p2p_start(True, mine, culprit, 6)]
        checks = sum(
            expect(eng, plait.MismatchError, q, "rank 2 failed: boom (a test)", within=1.5) for q in qs
        )
    try:  # a flagged group starts nothing
        eng.p2p_start(True, np.zeros(1), (r + 1) % eng.size, 0)
    except plait.MismatchError as e:
        assert str(e) == "rank 2 failed: boom (a test)", e
        checks += 1
    else:
        raise AssertionError("a flagged group started a transfer")
    MPI.COMM_WORLD.Barrier()
    return checks


def fail_from_thread(eng):
    """fail() from another thread while this rank tests its transfers: they end with fail()'s
    kind and message here and on the other rank (engine.h: any thread may call fail)."""
    r, peer = eng.rank, 1 - eng.rank
    got = np.zeros(3, dtype=np.int64)
    q = eng.p2p_start(False, got, peer, 21)  # nobody sends it
    if r == 0:
        threading.Timer(0.3, eng.fail, (PEER_LOST, "from a thread")).start()
    checks = expect(eng, plait.PeerLostError, q, "rank 0 failed: from a thread", within=2)
    MPI.COMM_WORLD.Barrier()
    return checks


def claimed_while_waiting(eng):
    """Rank 0 has a 1 MiB recv in flight and waits in an allreduce; rank 1 sends it blocking and
    only then joins the allreduce. The recv must take its message during that wait, on the same
    group and from another group's wait too, as MPI progresses a posted receive in any call."""
    r, peer, checks = eng.rank, 1 - eng.rank, 0
    other = _mpi.EngineForTests(_mpi.make_engine(MPI.COMM_WORLD, "other"))
    for group, tag in ((eng, 31), (other, 32)):
        a = np.full(3, r + 1, dtype=np.int64)
        if r == 0:
            got = np.full(BIG, -1, dtype=np.int64)
            q = group.p2p_start(False, got, peer, tag)
            eng.allreduce(a, "sum", timeout=30)
            finish(group, [q])
            assert np.array_equal(got, payload(peer, r, tag, BIG)), ("claimed", tag, got[:4])
        else:
            group.send(payload(r, peer, tag, BIG), peer, tag, timeout=30)
            eng.allreduce(a, "sum", timeout=30)
        assert (a == 3).all(), a
        checks += 1
    other.close()
    return checks


def probe_after_start(eng):
    """A recv of (1, tag 4) started before rank 1 sends two messages of that tag: probe(4) skips
    the first (that recv's) and names the second, which a blocking recv then takes."""
    r, checks = eng.rank, 0
    first, second = np.full(3, -1, dtype=np.int64), np.full(5, -1, dtype=np.int64)
    if r == 0:
        q = eng.p2p_start(False, first, 1, 4)
    MPI.COMM_WORLD.Barrier()
    if r == 1:
        eng.send(payload(1, 0, 4, 3), 0, 4)
        eng.send(payload(1, 0, 40, 5), 0, 4)
    MPI.COMM_WORLD.Barrier()
    if r == 0:
        deadline = time.monotonic() + 30
        while (seen := eng.probe(4))[0] < 0:
            assert time.monotonic() < deadline, "probe found nothing"
        assert seen == (1, 40), seen
        eng.recv(second, 1, 4)
        finish(eng, [q])
        assert np.array_equal(first, payload(1, 0, 4, 3)) and np.array_equal(second, payload(1, 0, 40, 5))
        assert eng.probe(4) == (-1, 0)
        checks += 1
    MPI.COMM_WORLD.Barrier()
    return checks


def stress(eng):
    """Every member starts, to and from every other, 24 transfers over 2 tags with sizes drawn
    from a seed both ends share (0 bytes to 160 KiB; 64-byte pieces on a second group), all
    before any test, then tests them in a shuffled order until each is done: every message lands
    whole in the recv started for it."""
    r, n, checks = eng.rank, eng.size, 0
    pieces = _mpi.EngineForTests(_mpi.make_engine(MPI.COMM_WORLD, "stress", 64))
    for group, most in ((eng, 20_000), (pieces, 300)):
        reqs, recvs = [], []
        for peer in range(n):
            if peer == r:
                continue
            for src, dst in ((r, peer), (peer, r)):
                rng = np.random.default_rng(1000 * src + dst + most)
                for i in range(24):
                    tag, count = 50 + i % 2, int(rng.integers(0, most)) if i % 5 else 0
                    if src == r:
                        reqs.append(
                            (group.p2p_start(True, buf := payload(src, dst, i, count), dst, tag), buf)
                        )
                    else:
                        buf = np.full(count, -1, dtype=np.int64)
                        reqs.append((group.p2p_start(False, buf, src, tag), buf))
                        recvs.append((buf, payload(src, dst, i, count)))
        order = np.random.default_rng(r).permutation(len(reqs))
        finish(group, [reqs[k][0] for k in order])
        for got, want in recvs:
            assert np.array_equal(got, want), ("stress", got.size, got[:4], want[:4])
        checks += 1
    pieces.close()
    return checks


def release(eng):
    """close() with transfers in flight (a recv nobody sends, a 1 MiB send nobody receives, a
    small send): no crash, no hang; a new group then works, and MPI finalises at exit."""
    r, peer = eng.rank, 1 - eng.rank
    keep = [np.zeros(4, dtype=np.int64), payload(r, peer, 12, BIG), payload(r, peer, 13, 3)]
    eng.p2p_start(False, keep[0], peer, 11 + 3 * r)
    if r == 0:
        eng.p2p_start(True, keep[1], peer, 12)
        eng.p2p_start(True, keep[2], peer, 13)
    t0 = time.monotonic()
    eng.close()
    assert time.monotonic() - t0 < 2, time.monotonic() - t0
    assert keep[0].tolist() == [0] * 4, keep[0]
    again = _mpi.EngineForTests(_mpi.make_engine(MPI.COMM_WORLD, "again"))
    checks = 1 + exchange(again, 7)
    again.close()
    return checks


def main():
    case, outdir = sys.argv[1], sys.argv[2]
    rank = MPI.COMM_WORLD.Get_rank()
    cases = {
        f.__name__: f
        for f in (
            exchange_all,
            ring,
            in_order,
            mismatch,
            timeout,
            fail,
            fail_from_thread,
            claimed_while_waiting,
            probe_after_start,
            stress,
            release,
        )
    }
    try:
        eng = _mpi.EngineForTests(_mpi.make_engine(MPI.COMM_WORLD, "test"))
        got = f"ok {cases[case](eng)}"
        eng.close()
    except BaseException:  # noqa: BLE001 - reported through the file
        got = traceback.format_exc()
    with open(os.path.join(outdir, f"{case}-{rank}"), "w") as f:
        f.write(got)


if __name__ == "__main__":
    main()
