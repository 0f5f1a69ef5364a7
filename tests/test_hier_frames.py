"""The cross-host check frame's room follows the calls (csrc/hier/hier_comm.h).

Every collective on a multi-host communicator first exchanges one frame per member: a header every
member compares, and the payload when it fits the frame's room. The room shrinks after a run of
small calls (small frames are cheaper engine messages) and grows at once for a larger payload.
Every rank must make the same choice from its own calls, so these tests run sequences that cross
the room's thresholds, with send/recv between hosts (which only some ranks make) mixed in, and
check every result exactly; a mismatch after the room has shrunk must still be a MismatchError on
every rank. 2 simulated hosts x 2 ranks (and 3 uneven hosts), gloo between them.
"""

import os

import numpy as np
import pytest

import plait
from conftest import run_ranks

torch = pytest.importorskip("torch")
import torch.distributed  # noqa: E402,F401,F811 - imported once in the parent, inherited by the forks

MIN_ROOM, MAX_ROOM, SHRINK_AFTER = 64, 1984, 16  # hier_comm.h: kMinRoom, kRoom, kShrinkAfter


def _init(rank, hosts):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    comm = plait.init(timeout=30)
    assert isinstance(comm, plait.HierCommunicator), repr(comm)
    return comm


def _room(comm):
    return comm._c._frame_room


def _allreduce(comm, count, salt=0):
    n, r = comm.size, comm.rank
    x = (np.arange(count, dtype=np.int64) % 13 + salt) * (r + 1)
    got = comm.allreduce(x)
    want = (np.arange(count, dtype=np.int64) % 13 + salt) * (n * (n + 1) // 2)
    assert np.array_equal(got, want), (count, got[:8], want[:8])


def _movements(comm, nbytes):
    n, r = comm.size, comm.rank
    x = np.full(nbytes, r + 1, dtype=np.uint8)
    got = comm.allgather(x).reshape(-1)  # one row per rank
    assert np.array_equal(got, np.repeat(np.arange(1, n + 1, dtype=np.uint8), nbytes)), nbytes
    b = np.full(nbytes, r + 7, dtype=np.uint8)
    comm.broadcast(b, root=n - 1)
    assert np.all(b == n - 1 + 7), nbytes
    blk = max(1, nbytes // n)
    a = np.repeat(np.arange(n, dtype=np.int32) + 100 * r, blk)
    got = comm.alltoall(a)
    assert np.array_equal(got, np.repeat(r + 100 * np.arange(n, dtype=np.int32), blk)), nbytes


def _p2p(comm, i):
    """Rank 0 and the last rank (on another host) trade a message; the others do not."""
    n, r = comm.size, comm.rank
    last = n - 1
    if r == 0:
        comm.send(np.array([i, 1], dtype=np.int64), last, tag=i)
        got = comm.recv(np.empty(2, dtype=np.int64), last, tag=i)
        assert list(got) == [i, 2]
    elif r == last:
        got = comm.recv(np.empty(2, dtype=np.int64), 0, tag=i)
        assert list(got) == [i, 1]
        comm.send(np.array([i, 2], dtype=np.int64), 0, tag=i)


def _sequence(rank, n, addr, hosts):
    comm = _init(rank, hosts)
    rooms = [_room(comm)]
    assert rooms[0] == MAX_ROOM  # a new communicator starts with the widest room
    for i in range(SHRINK_AFTER + 2):  # small calls: the room shrinks to the smallest
        _allreduce(comm, 2, salt=i)
        if i % 5 == 0:
            _p2p(comm, i)
    rooms.append(_room(comm))
    # 250 int64 = 2000 B: beyond every room (a header-only frame, then the engine's allreduce)
    _allreduce(comm, 250)
    rooms.append(_room(comm))
    _allreduce(comm, 100)  # 800 B: grows the room at once (this call: header-only, then data)
    rooms.append(_room(comm))
    _allreduce(comm, 100, salt=3)  # now it rides in the frame
    _allreduce(comm, 3)  # smaller calls keep the room until a run of them
    rooms.append(_room(comm))
    for nbytes in (1, 63, 64, 65, 128, 129, 500, 1984, 1985, 4096):  # around every threshold
        _movements(comm, nbytes)
        _allreduce(comm, max(1, nbytes // 8), salt=nbytes)
        _p2p(comm, nbytes)
    comm.barrier()
    rooms.append(_room(comm))
    comm.finalize()
    return rooms


@pytest.mark.parametrize(
    "hosts", [["a", "a", "b", "b"], ["a", "b", "b", "c", "c"]], ids=["2x2", "3-hosts-uneven"]
)
def test_room_follows_the_calls_and_every_result_is_exact(hosts):
    rooms = run_ranks(_sequence, len(hosts), args=(hosts,), timeout=240)
    assert all(r == rooms[0] for r in rooms), rooms  # every rank chose the same rooms
    start, shrunk, big, grown, kept, end = rooms[0]
    assert (start, shrunk, big, grown, kept) == (MAX_ROOM, MIN_ROOM, MIN_ROOM, 1024, 1024)
    assert MIN_ROOM <= end <= MAX_ROOM


def _mismatch_after_shrink(rank, n, addr, hosts, culprit):
    comm = _init(rank, hosts)
    for i in range(SHRINK_AFTER + 1):
        _allreduce(comm, 1, salt=i)
    assert _room(comm) == MIN_ROOM
    count = 300 if rank == culprit else 1  # 2400 B on one rank: a header-only frame there
    try:
        comm.allreduce(np.ones(count, dtype=np.int64))
        got = "no error"
    except plait.PlaitError as e:
        got = type(e).__name__
    comm.finalize()
    return got


@pytest.mark.parametrize("culprit", [0, 3])
def test_mismatch_after_the_room_shrank_raises_everywhere(culprit):
    hosts = ["a", "a", "b", "b"]
    got = run_ranks(_mismatch_after_shrink, 4, args=(hosts, culprit), timeout=120)
    assert got == ["MismatchError"] * 4, got
