"""plait.horovod's cached fast path (csrc/torch/horovod_fast.cc): a cached allreduce that runs
alone in a cycle is one native call. It gives exactly the Python cycle's results (sums, floating
Average as plait's avg, integer Average truncated, prescale/postscale, groups), falls back to the
Python cycle whenever a peer sends anything else (an idle cycle, a join, another shape), reports
a dead peer as the Python cycle does, and is absent where plait's torch module is not
(PLAIT_HOROVOD_NATIVE=0: the same results)."""

import math
import os
import time

import pytest

torch = pytest.importorskip("torch")

try:  # the fast path needs plait's torch module: compiled once here, not in a rank's deadline
    from plait.torch import _native

    _native.load()
    NATIVE = True
except ImportError:  # NativeBuildError: no fast path; the results must not change
    NATIVE = False

STEPS = 12
NAMES = 6  # cached names per step in _steady
# Idle cycles (every HOROVOD_CYCLE_TIME ms while a rank is between calls) meet a peer's fast cycle
# and make it fall back: rarer with a long cycle time, so that most steps take the fast path.
QUIET = {"HOROVOD_CYCLE_TIME": "200"}


def _hvd():
    import plait.horovod.torch as hvd

    hvd.init()
    return hvd


def _steady(rank, n, _addr, python_ranks=()):
    if rank in python_ranks:  # this rank takes the Python cycle only; its peers may go native
        os.environ["PLAIT_HOROVOD_NATIVE"] = "0"
    hvd = _hvd()
    from plait.horovod.common import basics

    ctrl = basics.controller()
    tri = n * (n - 1) // 2
    g = [torch.zeros(k + 1) for k in range(6)]
    for step in range(STEPS):
        x = torch.full((5,), float(rank + step))
        assert hvd.allreduce_(x, op=hvd.Sum, name="s") is x
        assert x.tolist() == [n * step + tri] * 5, step
        y = torch.full((3,), 2.0 * (rank + 1), dtype=torch.float64)
        hvd.allreduce_(y, op=hvd.Average, name="a")  # avg of 2, 4, ..., 2n
        assert y.tolist() == [n + 1.0] * 3, step
        v = torch.tensor([1, -1, 7, -7], dtype=torch.int32) * (rank + 1)
        hvd.allreduce_(v, op=hvd.Average, name="i")  # sum then 1/n, truncated toward zero
        assert v.tolist() == [math.trunc(c * (n + 1) / 2) for c in (1, -1, 7, -7)], step
        z = torch.full((4,), float(rank + 1))
        hvd.allreduce_(z, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5, name="p")
        assert z.tolist() == [0.75 * n * (n + 1)] * 4, step
        for t in g:
            t.fill_(rank + step)
        hvd.grouped_allreduce_(g, op=hvd.Average, name="g")
        assert [t.tolist() for t in g] == [[step + (n - 1) / 2] * (k + 1) for k in range(6)], step
        empty = torch.zeros(0)  # no elements: the same (empty) plait call as the Python path's
        assert hvd.allreduce_(empty, op=hvd.Sum, name="z").shape == (0,)
    fast = ctrl.fast_cycles
    hvd.shutdown()
    return fast


@pytest.mark.parametrize("n", [2, 3])
def test_steady_state_is_exact_and_fast(ranks, n):
    fast = ranks(_steady, n, env=QUIET, timeout=120)
    if not NATIVE:
        assert fast == [0] * n
        return
    # every name's first run builds its plan; most later ones run natively on every rank
    assert all(f >= (STEPS - 1) * NAMES // 2 for f in fast), fast


def test_numpy_fallback_same_results(ranks):
    assert ranks(_steady, 2, env=dict(QUIET, PLAIT_HOROVOD_NATIVE="0"), timeout=120) == [0, 0]


def test_native_and_python_ranks_together(ranks):
    """A rank on the native path and one on the Python path make the same plait calls."""
    fast = ranks(_steady, 2, args=((1,),), env=QUIET, timeout=120)
    assert fast[1] == 0, fast
    if NATIVE:
        assert fast[0] >= (STEPS - 1) * NAMES // 2, fast


def _joined_peers(rank, n, _addr):
    hvd = _hvd()
    last = n - 1
    ones = torch.ones(3)
    for _ in range(6):  # cached, then native on every rank
        ones.fill_(1.0)
        hvd.allreduce_(ones, op=hvd.Average, name="j")
        assert ones.tolist() == [1.0] * 3
    if rank != last:
        assert hvd.join() == last
    else:
        # The others have joined: they add zeros, and Average still divides by n (Horovod's).
        for _ in range(4):
            ones.fill_(float(n))
            hvd.allreduce_(ones, op=hvd.Average, name="j")
            assert ones.tolist() == [1.0] * 3
            ones.fill_(2.0)
            hvd.allreduce_(ones, op=hvd.Sum, name="j")
            assert ones.tolist() == [2.0] * 3
        assert hvd.join() == last
    # after the join: the cached name runs on every rank again
    for _ in range(3):
        ones.fill_(float(rank))
        hvd.allreduce_(ones, op=hvd.Sum, name="j")
        assert ones.tolist() == [n * (n - 1) / 2] * 3
    hvd.shutdown()
    return True


@pytest.mark.parametrize("n", [2, 3])
def test_join_after_steady_state(ranks, n):
    assert ranks(_joined_peers, n, env=QUIET, timeout=120) == [True] * n


def _late_peer(rank, n, _addr):
    hvd = _hvd()
    g = [torch.zeros(4) for _ in range(3)]
    for step in range(10):
        if rank == 1 and step % 2:
            time.sleep(0.02)  # rank 0's fast cycle meets rank 1's idle cycles: it falls back
        for t in g:
            t.fill_(rank + step)
        hvd.grouped_allreduce_(g, op=hvd.Sum, name="late")
        assert [t.tolist() for t in g] == [[n * step + 1] * 4] * 3, step
    hvd.shutdown()
    return True


def test_late_peer_falls_back(ranks):
    assert ranks(_late_peer, 2, timeout=90) == [
        True,
        True,
    ]  # default cycle time: idle cycles every millisecond


def _killed_in_steady_state(rank, n, _addr):
    import signal

    hvd = _hvd()
    x = torch.ones(2)
    for _ in range(5):
        hvd.allreduce_(x, op=hvd.Sum, name="k")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(hvd.HorovodInternalError) as e:
        hvd.allreduce_(x, op=hvd.Sum, name="k")
    msg = str(e.value)
    assert "PeerLostError" in msg and "rank 1" in msg, msg
    assert isinstance(e.value.flight, dict) and e.value.flight, e.value.flight
    with pytest.raises(hvd.HorovodInternalError):
        hvd.allreduce_(x, op=hvd.Sum, name="k")
    hvd.shutdown()
    return True


def test_killed_peer_in_steady_state(ranks):
    assert ranks(_killed_in_steady_state, 2, env=QUIET, may_die=(1,), timeout=60)[0] is True


def _sets(rank, n, _addr):
    hvd = _hvd()
    x = torch.zeros(3)
    for rounds in range(2):  # the second round's set is a new communicator: plans are rebuilt
        evens = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
        for step in range(6):
            x.fill_(rank + step)
            if rank % 2 == 0:
                hvd.allreduce_(x, op=hvd.Sum, name="e", process_set=evens)
                assert x.tolist() == [sum(r + step for r in evens.ranks)] * 3, (rounds, step)
            x.fill_(rank + step)
            hvd.allreduce_(x, op=hvd.Average, name="w")
            assert x.tolist() == [step + (n - 1) / 2] * 3, (rounds, step)
        assert hvd.remove_process_set(evens)
    hvd.shutdown()
    return True


def test_process_set_plans(ranks):
    assert ranks(_sets, 3, timeout=120) == [True] * 3
