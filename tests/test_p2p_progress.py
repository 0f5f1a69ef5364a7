"""Send/recv in flight across collectives: a receive (or send) posted before a collective must not
keep that collective from running, and must keep moving while it waits (MPI's progress rule;
gloo's and NCCL's send/recv do not wait for the group's collectives either). Before the progress
thread set such a batch aside (core/p2p.cc, run_p2p's parking), `irecv; allreduce; wait` against
`allreduce; send` deadlocked until the deadline on one host, and `irecv; iallreduce; send` on
every rank too. Exact integer data, world sizes 2, 3 and 4 (4 and 3 oversubscribe this machine's
cores), messages of one chunk and of many (a small staging buffer gives 4 KiB slots)."""

import os
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks

TIMEOUT = 20
BIG = 5000  # float64 elements: many slots at buffer_bytes=8192


def _msg(src, dst, k, tag=0):
    return ((1000 * src + 10 * dst + tag + np.arange(k)) % 65521).astype(np.float64)


def _ranks_sum(n, k):
    return (np.arange(k, dtype=np.float64) % 7) * n + n * (n - 1) / 2


def _mine(rank, k):
    return (np.arange(k, dtype=np.float64) % 7) + rank


def _pre_posted(rank, n, addr, count):
    """Rank 0 posts a receive from the last rank, joins an allreduce, then waits; the last rank
    sends with a blocking call first, late (rank 0 has set its receive aside and waits in the
    allreduce by then; the send ends only once rank 0 took every chunk, which it does from inside
    that wait), then joins. Then the same the other way round: rank 0
    posts a send first, the last rank receives after the allreduce."""
    last = n - 1
    with plait.init(rank, n, store=addr, timeout=TIMEOUT, buffer_bytes=8192) as comm:
        x = _mine(rank, 33)
        got = np.zeros(count)
        if rank == 0:
            h = comm.recv(got, last, tag=5, async_op=True)
            comm.allreduce(x, out=x)
            h.wait()
            assert (got == _msg(last, 0, count, 5)).all()
        elif rank == last:
            time.sleep(0.3)
            comm.send(_msg(last, 0, count, 5), 0, tag=5)
            comm.allreduce(x, out=x)
        else:
            comm.allreduce(x, out=x)
        assert (x == _ranks_sum(n, 33)).all()
        y = _mine(rank, 1000)
        if rank == 0:
            h = comm.send(_msg(0, last, count, 6), last, tag=6, async_op=True)
            comm.allreduce(y, out=y)
            h.wait()
        elif rank == last:
            comm.allreduce(y, out=y)
            comm.recv(got, 0, tag=6)
            assert (got == _msg(0, last, count, 6)).all()
        else:
            comm.allreduce(y, out=y)
        assert (y == _ranks_sum(n, 1000)).all()
        return True


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("count", [1, BIG])
def test_receive_posted_before_a_collective_its_sender_reaches_later(n, count):
    assert run_ranks(_pre_posted, n, timeout=90, args=(count,)) == [True] * n


def _ring_around_collectives(rank, n, addr, count, asyn):
    """Every rank: irecv from the left, one or three collectives (sync, or async and waited at
    the end), a blocking send to the right, then waits: a ring whose sends come after the
    collectives."""
    left, right = (rank - 1) % n, (rank + 1) % n
    with plait.init(rank, n, store=addr, timeout=TIMEOUT, buffer_bytes=8192) as comm:
        got = np.zeros(count)
        h = comm.recv(got, left, tag=3, async_op=True)
        x = _mine(rank, 77)
        b = np.full(5, float(rank))
        g = np.zeros(3 * n)
        calls = [
            lambda: comm.allreduce(x, out=x, async_op=asyn),
            lambda: comm.broadcast(b, root=n - 1, async_op=asyn),
            lambda: comm.allgather(np.full(3, float(rank)), out=g, async_op=asyn),
        ]
        handles = [c() for c in calls]
        comm.send(_msg(rank, right, count, 3), right, tag=3)
        h.wait()
        for w in handles if asyn else ():
            w.wait()
        assert (got == _msg(left, rank, count, 3)).all()
        assert (x == _ranks_sum(n, 77)).all()
        assert (b == n - 1).all()
        assert (g == np.repeat(np.arange(n, dtype=np.float64), 3)).all()
        return True


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("asyn", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("count", [0, 1, BIG])
def test_ring_exchange_around_collectives(n, asyn, count):
    assert run_ranks(_ring_around_collectives, n, timeout=90, args=(count, asyn)) == [True] * n


def _stashed_while_waiting(rank, n, addr):
    """Rank 1's blocking send of tag 9 (late: rank 0 waits in the allreduce by then) heads the
    channel while rank 0's parked receive wants tag 7:
    rank 0 sets tag 9 aside from inside its allreduce's wait, so rank 1's send ends, its tag 7 send
    follows, and both reach the allreduce."""
    with plait.init(rank, n, store=addr, timeout=TIMEOUT, buffer_bytes=8192) as comm:
        x = _mine(rank, 9)
        if rank == 0:
            seven, nine = np.zeros(3), np.zeros(BIG)
            h = comm.recv(seven, 1, tag=7, async_op=True)
            comm.allreduce(x, out=x)
            comm.recv(nine, 1, tag=9)
            h.wait()
            assert (seven == _msg(1, 0, 3, 7)).all() and (nine == _msg(1, 0, BIG, 9)).all()
        else:
            time.sleep(0.3)
            comm.send(_msg(1, 0, BIG, 9), 0, tag=9)
            comm.send(_msg(1, 0, 3, 7), 0, tag=7)
            comm.allreduce(x, out=x)
        assert (x == _ranks_sum(n, 9)).all()
        return True


def test_message_of_another_tag_is_set_aside_during_a_collective():
    assert run_ranks(_stashed_while_waiting, 2, timeout=60) == [True, True]


def _mismatch_while_waiting(rank, n, addr):
    """A parked receive meets a message of another size while rank 0 waits in an allreduce (rank 1
    sends late and joins later still): a MismatchError on every rank (rank 0's allreduce and its
    receive, rank 1's allreduce), naming the receive and the send, within the deadline."""
    with plait.init(rank, n, store=addr, timeout=TIMEOUT, buffer_bytes=8192) as comm:
        x = _mine(rank, 9)
        errors = []
        if rank == 0:
            h = comm.recv(np.zeros(10), 1, tag=2, async_op=True)
            for f in (lambda: comm.allreduce(x, out=x), h.wait):
                try:
                    f()
                except plait.MismatchError as e:
                    errors.append(str(e))
        else:
            time.sleep(0.3)
            comm.send(np.ones(20), 0, tag=2, async_op=True)
            time.sleep(0.5)
            try:
                comm.allreduce(x, out=x)
            except plait.MismatchError as e:
                errors.append(str(e))
        return errors


def test_mismatch_found_during_a_collective_raises_on_every_rank():
    res = run_ranks(_mismatch_while_waiting, 2, timeout=60)
    assert len(res[0]) == 2 and len(res[1]) == 1, res
    for msg in res[0] + res[1]:
        assert "mismatched send/recv" in msg and "80 bytes" in msg and "160 bytes" in msg, msg


def _torch_around(rank, n, store_dir, hosts):
    """torch.distributed on "plait": irecv from the left, a sync and an async all_reduce, a blocking
    send to the right, then the waits; on one host and across hosts (the receive from another
    host is an engine transfer in flight while the collective runs)."""
    import torch
    import torch.distributed as dist

    from test_torch_backend import init_pg

    if hosts:
        os.environ["PLAIT_HOST_ID"] = hosts[rank]
    init_pg("plait", rank, n, store_dir, timeout=TIMEOUT)
    left, right = (rank - 1) % n, (rank + 1) % n
    got = torch.zeros(BIG, dtype=torch.float64)
    req = dist.irecv(got, left, tag=1)
    x = torch.from_numpy(_mine(rank, 21))
    dist.all_reduce(x)
    w = dist.all_reduce(y := torch.full((4,), float(rank)), async_op=True)
    dist.send(torch.from_numpy(_msg(rank, right, BIG, 1)), right, tag=1)
    req.wait()
    w.wait()
    assert (got.numpy() == _msg(left, rank, BIG, 1)).all()
    assert (x.numpy() == _ranks_sum(n, 21)).all() and (y == n * (n - 1) / 2).all()
    return True


@pytest.mark.parametrize(
    "hosts", [None, ["a", "a", "b", "b"], ["a", "a", "b", "c"]], ids=["one-host", "2x2", "3-hosts-uneven"]
)
def test_torch_receive_posted_before_collectives(tmp_path, hosts):
    pytest.importorskip("torch")
    from test_torch_backend import run_torch

    n = len(hosts) if hosts else 3
    assert run_torch(_torch_around, n, tmp_path, timeout=120, args=(hosts,)) == [True] * n


def _sender_dies(rank, n, addr, how):
    """Rank 0 has a receive from rank 1 set aside and waits in an allreduce. Rank 1 is killed
    (PeerLostError) or never sends and never joins (TimeoutError at rank 0's deadline): the
    allreduce and the receive raise on rank 0, and the rank that did join raises too, within the
    deadline."""
    import signal

    with plait.init(rank, n, store=addr, timeout=5 if how == "late" else 30, buffer_bytes=8192) as comm:
        comm.barrier()
        start = time.monotonic()
        errors = []
        if rank == 1:
            time.sleep(0.3)
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(8)  # past the others' 5 s deadline: they time out, nobody is lost
            return None
        x = _mine(rank, 9)
        h = comm.recv(np.zeros(BIG), 1, tag=4, async_op=True) if rank == 0 else None
        for f in (lambda: comm.allreduce(x, out=x), h.wait if h else (lambda: None)):
            try:
                f()
            except plait.PlaitError as e:
                errors.append((type(e).__name__, str(e)))
        return errors, time.monotonic() - start


@pytest.mark.parametrize("how", ["killed", "late"])
def test_sender_lost_while_a_receive_is_parked(how):
    res = run_ranks(_sender_dies, 3, timeout=90, args=(how,), may_die=(1,) if how == "killed" else ())
    want = "PeerLostError" if how == "killed" else "TimeoutError"
    errors, took = res[0]
    assert [k for k, _ in errors] == [want, want] and took < 20, res[0]
    assert all("rank 1" in m for _, m in errors), errors
    errors, took = res[2]
    assert [k for k, _ in errors] == [want] and took < 20, res[2]
