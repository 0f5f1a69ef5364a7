"""send/recv matched by (sender, tag), as gloo matches them: async receives take the first
message of their tag, whatever order the sender used; messages nobody has asked for yet wait
aside (plait's stash) for a later receive. Blocking receives keep plait's strict order (their
mismatches are in test_errors.py)."""

import time

import numpy as np
import plait
from conftest import run_ranks

BIG = 70_001  # float64 elements: many chunks of a pair slot, so stashing spans chunks


def _msg(tag, count):
    return (np.arange(count, dtype=np.float64) % 1000) + tag * 1000


def _tags(rank, n, store):
    with plait.init(rank, n, store=store, timeout=20) as comm:
        if rank == 0:
            for tag, count in ((7, 5), (9, 3), (7, BIG), (11, BIG), (5, 1), (1, 2), (2, 2), (3, 2)):
                comm.send(_msg(tag, count), 1, tag=tag, async_op=True).wait()
            comm.barrier()
            return True
        # posted out of order: 9 before 7 (the case), two of tag 7 in order
        got = {k: np.empty(c) for k, c in (("9", 3), ("7a", 5), ("7b", BIG))}
        hs = [
            comm.recv(got["9"], 0, tag=9, async_op=True),
            comm.recv(got["7a"], 0, tag=7, async_op=True),
            comm.recv(got["7b"], 0, tag=7, async_op=True),
        ]
        for h in reversed(hs):
            h.wait()
        # one at a time, each waited before the next is posted: 5 went aside behind 11
        five, eleven = np.empty(1), np.empty(BIG)
        comm.recv(five, 0, tag=5, async_op=True).wait()
        comm.recv(eleven, 0, tag=11, async_op=True).wait()
        # two posted receives that want neither head message: 1 goes aside once, 2 and 3 match
        m = {t: np.empty(2) for t in (1, 2, 3)}
        h3, h2 = comm.recv(m[3], 0, tag=3, async_op=True), comm.recv(m[2], 0, tag=2, async_op=True)
        h3.wait(), h2.wait()
        comm.recv(m[1], 0, tag=1, async_op=True).wait()
        comm.barrier()
        ok = {
            "9": np.array_equal(got["9"], _msg(9, 3)),
            "7a": np.array_equal(got["7a"], _msg(7, 5)),
            "7b": np.array_equal(got["7b"], _msg(7, BIG)),
            "5": np.array_equal(five, _msg(5, 1)),
            "11": np.array_equal(eleven, _msg(11, BIG)),
            "1-3": all(np.array_equal(m[t], _msg(t, 2)) for t in (1, 2, 3)),
        }
        return ok


def test_async_receives_match_by_tag():
    res = run_ranks(_tags, 2, timeout=60)
    assert res[1] == {k: True for k in ("9", "7a", "7b", "5", "11", "1-3")}, res[1]


def _stashed_mismatch(rank, n, store):
    with plait.init(rank, n, store=store, timeout=5) as comm:
        if rank == 0:
            comm.send(np.ones(4), 1, tag=3, async_op=True).wait()
            comm.send(np.ones(2), 1, tag=1, async_op=True).wait()
            return "sent"
        comm.recv(np.empty(2), 0, tag=1, async_op=True).wait()  # tag 3 goes aside
        try:
            comm.recv(np.empty(5), 0, tag=3, async_op=True).wait()  # 5 elements, 4 were sent
        except plait.MismatchError as e:
            return str(e)
        return "no error"


def test_stashed_message_of_another_size_is_a_mismatch():
    msg = run_ranks(_stashed_mismatch, 2, timeout=60)[1]
    assert "tag=3" in msg and "40 bytes" in msg and "32 bytes" in msg, msg


def _any_source(rank, n, store):
    with plait.init(rank, n, store=store, timeout=20) as comm:
        if rank:
            if rank == n - 1:  # late: rank 0's blocking any-source recvs meet its unwanted tag 8 first
                time.sleep(0.3)
            comm.send(np.full(3, 100.0 + rank), 0, tag=8, async_op=True).wait()  # unwanted: stashed
            comm.send(np.full(4, float(rank)), 0, tag=5, async_op=True).wait()
            comm.send(np.full(4, 10.0 * rank), 0, tag=5)
            comm.barrier()
            return True
        got = [np.empty(4) for _ in range(2 * (n - 1))]
        hs = [comm.recv(got[k], -1, tag=5, async_op=True) for k in range(n - 1)]  # -1: any source
        for h in hs:
            h.wait()
        for k in range(n - 1, 2 * (n - 1)):
            comm.recv(got[k], -1, tag=5)  # blocking, from any source too
        stashed = [np.empty(3) for _ in range(n - 1)]
        for s in stashed:
            comm.recv(s, -1, tag=8, async_op=True).wait()
        comm.barrier()
        # a sender's two tag-5 messages arrive in its order; all of them arrive once
        return (
            all(len(set(g.tolist())) == 1 for g in got),
            sorted(float(g[0]) for g in got),
            sorted(float(s[0]) for s in stashed),
        )


def test_recv_from_any_source():
    n = 3
    ok, values, stashed = run_ranks(_any_source, n, timeout=60)[0]
    assert ok and values == sorted([float(r) for r in range(1, n)] + [10.0 * r for r in range(1, n)]), values
    assert stashed == [100.0 + r for r in range(1, n)], stashed


def _exchange_late_send(rank, n, store, pause):
    """Each rank posts a receive, then (after some work: the progress thread is already waiting in
    the receive's batch) sends with a blocking call: the send must join that batch, not wait for the
    progress thread's lock behind the receive (which waits for the peer's send)."""
    with plait.init(rank, n, store=store, timeout=20) as comm:
        peer = 1 - rank
        out = np.zeros(BIG)
        h = comm.recv(out, peer, tag=4, async_op=True)
        time.sleep(pause)
        comm.send(_msg(rank, BIG), peer, tag=4)
        h.wait()
        return bool((out == _msg(peer, BIG)).all())


def test_irecv_then_late_blocking_send_on_both_ranks():
    for pause in (0.0, 0.05):
        assert run_ranks(_exchange_late_send, 2, timeout=60, args=(pause,)) == [True, True], pause
