"""Faults on one host of a multi-host communicator reach every rank of every host, at once.

2 simulated hosts x 2 ranks (PLAIT_HOST_ID per rank), gloo between them, the C++ communicator
(csrc/hier/hier_comm.h) over _C._py_engine. Bad input on one rank (a wrong dtype or count: a
mismatch; a bad root: invalid usage) raises on every rank within seconds, the same class
everywhere, and leaves the communicator aborted; a rank killed with SIGKILL is a PeerLostError on
every other rank within seconds (well inside the call deadline), and nothing stays in /dev/shm
(run_ranks checks).
"""

import os
import signal
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks

torch = pytest.importorskip("torch")
import torch.distributed  # noqa: E402,F401,F811 - imported once in the parent, inherited by the forks

HOSTS = ["a", "a", "b", "b"]  # host 0: ranks 0, 1; host 1: ranks 2, 3


def _init(rank, timeout=30):
    os.environ["PLAIT_HOST_ID"] = HOSTS[rank]
    return plait.init(timeout=timeout)


def _bad(rank, n, addr, case, culprit, count, async_op):
    comm = _init(rank)
    assert isinstance(comm, plait.HierCommunicator), repr(comm)
    comm.barrier()  # every engine group connected before anyone fails
    odd = rank == culprit
    x = np.ones(count, dtype=np.float32)
    start = time.monotonic()
    try:
        if case == "dtype":
            h = comm.allreduce(x.astype(np.int32) if odd else x, async_op=async_op)
        elif case == "count":
            h = comm.allreduce(x[: count - 1] if odd else x, async_op=async_op)
        elif case == "any-source":  # a tag no other host can send: the others' barrier hears of it
            h = comm.recv(x, -1, tag=1 << 40, async_op=async_op) if odd else comm.barrier(async_op=async_op)
        else:  # a root outside the communicator: refused before anything leaves this rank
            out = np.empty_like(x)
            h = comm.reduce(x, root=n + 3 if odd else 0, out=out, async_op=async_op)
        if async_op:
            h.wait()
        got = ("no error", 0.0, "")
    except plait.PlaitError as e:
        got = (type(e).__name__, time.monotonic() - start, str(e))
    try:
        comm.allreduce(np.ones(4, dtype=np.float32))
        after = "no error"
    except plait.PlaitError as e:
        after = str(e)
    comm.finalize()
    return got, after


@pytest.mark.parametrize(
    "case,culprit,count,async_op",
    [
        ("dtype", 1, 8, False),  # in the frame: its shard group (1, 3) compares headers
        ("dtype", 3, 3001, True),  # past the frame's room: the header-only frame, async
        ("count", 2, 8, True),
        ("count", 0, 3001, False),
        ("root", 3, 8, False),
        ("root", 0, 8, True),
        ("any-source", 2, 8, False),
    ],
)
def test_bad_input_on_one_rank_raises_on_every_rank_of_every_host(case, culprit, count, async_op):
    res = run_ranks(_bad, 4, timeout=90, args=(case, culprit, count, async_op))
    want = "InvalidArgument" if case in ("root", "any-source") else "MismatchError"
    for r, ((kind, took, msg), after) in enumerate(res):
        assert kind == want and took < 5, (r, kind, took, msg)
        assert msg.startswith(f"rank {r}: "), (r, msg)
        if case == "root":
            # the culprit's own refusal reaches every host: every rank names it
            assert f"rank {culprit}: reduce" in msg and "root 7" in msg, (r, msg)
        if case == "any-source":
            assert f"rank {culprit}: recv: tag {1 << 40} from any rank" in msg, (r, msg)
        assert "aborted after an earlier error" in after, (r, after)
    if case not in ("root", "any-source"):
        # a rank that compared headers names both calls and both hosts
        assert any("mismatched calls across hosts" in m and "(host " in m for (_, _, m), _ in res), res


def _killed(rank, n, addr, victim):
    comm = _init(rank, timeout=60)
    x = np.ones(1000, dtype=np.float32)
    for i in range(1000000):
        if rank == victim and i == 30:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            if i % 3 == 0:
                comm.allreduce(x, out=np.empty_like(x))
            elif i % 3 == 1:
                comm.allgather(x[:3], async_op=True).wait()
            else:
                comm.broadcast(np.arange(5000.0), root=i % n)
        except plait.PlaitError as e:
            return type(e).__name__, time.monotonic(), str(e)
    return "no error", time.monotonic(), ""


@pytest.mark.parametrize("victim", [1, 2])
def test_rank_killed_on_one_host_is_peer_lost_everywhere(victim):
    start = time.monotonic()
    res = run_ranks(_killed, 4, timeout=90, args=(victim,), may_die=(victim,))
    for r, got in enumerate(res):
        if r == victim:
            assert got is None
            continue
        kind, when, msg = got
        # never the 60 s deadline: the local segment or the engine sees the death
        assert kind == "PeerLostError" and when - start < 25, (r, kind, when - start, msg)


def _dropped(rank, n, addr):
    import gc
    import weakref

    os.environ["PLAIT_HOST_ID"] = HOSTS[rank]
    comm = plait.init(timeout=30, set_default=False)
    gone = weakref.ref(comm._c)
    x = np.full(5000, rank + 1, dtype=np.float32)  # past the frame's room: several engine steps
    hs = [comm.allreduce(x, out=np.empty_like(x), async_op=True) for _ in range(3)]
    del hs
    # dropped with its calls queued and no finalize: the native communicator finishes them first
    # (their engine steps take the GIL this thread gives up), then its engines and segment go
    del comm
    gc.collect()
    assert gone() is None, "the native communicator outlived its last reference"
    fresh = _init(rank)
    total = fresh.allreduce(np.full(3, rank + 1, dtype=np.int64)).tolist()
    fresh.finalize()
    return total


def test_dropped_without_finalize_finishes_its_calls_and_does_not_hang():
    assert run_ranks(_dropped, 4, timeout=60) == [[10, 10, 10]] * 4
