"""A receive from any rank on a multi-host communicator (csrc/hier/hier_p2p.cc), gloo between
simulated hosts (PLAIT_HOST_ID per rank): local and remote senders race, every message arrives
once with its sender, and a wrong size or an absent sender is a typed error, never a hang. The
same checks under the MPI engine are in test_hier_mpi.py."""

import os
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks

import hier_checks as hc

torch = pytest.importorskip("torch")
import torch.distributed  # noqa: E402,F401,F811 - imported once in the parent, inherited by the forks

LAYOUTS = {
    "2x1": ["a", "b"],
    "2x2": ["a", "a", "b", "b"],
    "3-hosts-uneven": ["a", "a", "b", "c"],
}


def _init(rank, hosts, **kw):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    return plait.init(timeout=kw.pop("timeout", 30), **kw)


def _exactly_once(rank, n, addr, hosts):
    comm = _init(rank, hosts, buffer_bytes=8192)  # small staging: tag 8's local sends take chunks
    assert isinstance(comm, plait.HierCommunicator) and comm.engine == "gloo", repr(comm)
    checks = hc.any_source(comm)
    checks += hc.any_source(comm, big=7)  # again, all small: inline in the engine's headers
    comm.finalize()
    return checks


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_message_once_with_its_sender(layout):
    hosts = LAYOUTS[layout]
    n = len(hosts)
    got = run_ranks(_exactly_once, n, timeout=120, args=(hosts,))
    assert got == [8 * (n - 1)] + [2] * (n - 1), got


def _mismatch(rank, n, addr, hosts, sender):
    comm = _init(rank, hosts)
    comm.barrier()
    start = time.monotonic()
    try:
        if rank == 0:
            comm.recv(np.zeros(4, dtype=np.int64), -1, tag=3)
        elif rank == sender:
            comm.send(np.zeros(5, dtype=np.int64), 0, tag=3)  # 40 bytes where 32 are expected
            comm.barrier()
        else:
            comm.barrier()
    except plait.PlaitError as e:
        return type(e).__name__, time.monotonic() - start, str(e)
    return "no error", 0.0, ""


@pytest.mark.parametrize("sender", [1, 3], ids=["same-host", "other-host"])
def test_size_mismatch_is_a_mismatch_error(sender):
    res = run_ranks(_mismatch, 4, timeout=90, args=(LAYOUTS["2x2"], sender))
    kind, took, msg = res[0]
    assert kind == "MismatchError" and took < 10, res[0]
    assert "40 bytes" in msg and "32 bytes" in msg and f"rank {sender}" in msg, msg
    for r, (kind, took, msg) in enumerate(res[1:], 1):
        assert kind in ("MismatchError", "PeerLostError", "PlaitError") and took < 15, (r, kind, msg)


def _recv_any_outcome(comm, rank, **kw):
    """Rank 0 receives from any rank (nobody sends) while the others wait in a barrier:
    (error class name, seconds it took, message) on each rank."""
    comm.barrier()
    start = time.monotonic()
    try:
        if rank == 0:
            comm.recv(np.zeros(2), -1, **kw)
        else:
            comm.barrier()
    except plait.PlaitError as e:
        return type(e).__name__, time.monotonic() - start, str(e)
    return "no error", 0.0, ""


def _no_sender(rank, n, addr, hosts):
    return _recv_any_outcome(_init(rank, hosts), rank, tag=4, timeout=1.0)


def test_no_sender_is_a_timeout_at_the_deadline():
    res = run_ranks(_no_sender, 3, timeout=90, args=(LAYOUTS["3-hosts-uneven"][1:],))
    kind, took, msg = res[0]
    assert kind == "TimeoutError" and 0.9 < took < 5, res[0]
    assert "recv from any rank (tag=4, 16 bytes, float64)" in msg and "deadline passed" in msg, msg
    for r, (kind, took, _msg) in enumerate(res[1:], 1):
        assert kind != "no error" and took < 15, (r, res[r])  # the others hear of it, promptly


def _without_probe(rank, n, addr, hosts):
    from plait import _hier

    _hier._native_engine = lambda *a, **k: None  # plait._inter's Python groups: no probe
    return _recv_any_outcome(_init(rank, hosts), rank, tag=1)


def test_engine_without_probe_refuses_on_every_rank():
    res = run_ranks(_without_probe, 2, timeout=90, args=(LAYOUTS["2x1"],))
    for r, (kind, took, msg) in enumerate(res):
        assert kind == "InvalidArgument" and took < 10, (r, res[r])
        assert "rank 0: recv: a receive from any rank (peer=-1) needs an engine that can probe" in msg, msg
        assert "the gloo engine here cannot" in msg, msg


def _failure_elsewhere(rank, n, addr, hosts, how):
    import signal

    comm = _init(rank, hosts, timeout=60)
    comm.barrier()
    start = time.monotonic()
    try:
        if rank == 0:
            comm.recv(np.zeros(2), -1, tag=1)  # nobody sends: only the failure can end it early
        elif rank == n - 1:
            time.sleep(0.3)
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            comm.allreduce(np.ones(3), op="bogus")
        else:
            comm.barrier()
    except plait.PlaitError as e:
        return type(e).__name__, time.monotonic() - start, str(e)
    return "no error", 0.0, ""


@pytest.mark.parametrize(
    "hosts,how",
    [(["a", "b", "c"], "bad-argument"), (["a", "b", "a"], "killed")],
    ids=["bad-argument-on-another-host", "same-host-rank-killed"],
)
def test_failure_ends_a_waiting_any_source_recv(hosts, how):
    """A recv from any rank that nobody serves ends with the job's failure, well before its
    60 s deadline: another host's through the engine's job-wide flag (the probe looks at it), a
    dead rank of its own host through the local segment."""
    n = len(hosts)
    dies = (n - 1,) if how == "killed" else ()
    res = run_ranks(_failure_elsewhere, n, timeout=90, args=(hosts, how), may_die=dies)
    kind, took, msg = res[0]
    want = "InvalidArgument" if how == "bad-argument" else "PeerLostError"
    assert kind == want and took < 15, res[0]
    assert ("bogus" if how == "bad-argument" else "died") in msg, msg


def _no_header(rank, n, addr, hosts):
    os.environ["PLAIT_GLOO_PROBE"] = "0"  # every rank: plain named transfers, no probe
    comm = _init(rank, hosts)
    peer = 1 - rank
    for count in (0, 3, 100, 16384):  # inline-sized, past the header's room, 64 KiB of int32
        x = np.arange(count, dtype=np.int32) + 1000 * rank
        out = np.zeros(count, np.int32)
        if rank == 0:
            comm.send(x, peer, tag=count % 7)
            comm.recv(out, peer, tag=count % 7)
        else:
            comm.recv(out, peer, tag=count % 7)
            comm.send(x, peer, tag=count % 7)
        assert (out == np.arange(count, dtype=np.int32) + 1000 * peer).all(), (count, out[:4])
    return _recv_any_outcome(comm, rank, tag=1)


def test_without_the_gloo_header_named_transfers_work_and_any_source_is_refused():
    res = run_ranks(_no_header, 2, timeout=90, args=(LAYOUTS["2x1"],))
    for r, (kind, took, msg) in enumerate(res):
        assert kind == "InvalidArgument" and took < 10, (r, res[r])
        assert "needs an engine that can probe" in msg and "PLAIT_GLOO_PROBE=0" in msg, msg


def _header_differs(rank, n, addr, hosts):
    if rank == 1:
        os.environ["PLAIT_GLOO_PROBE"] = "0"
    try:
        _init(rank, hosts)
    except plait.InvalidArgument as e:  # plait.torch's subclass of it, raised by the engine
        return "InvalidArgument", str(e)
    except plait.PlaitError as e:  # a rank that heard of a peer's failure first (the init relay)
        return type(e).__name__, str(e)
    return "no error", ""


def test_gloo_probe_setting_that_differs_between_ranks_fails_init_on_every_rank():
    res = run_ranks(_header_differs, 2, timeout=90, args=(LAYOUTS["2x1"],))
    assert any(kind == "InvalidArgument" for kind, _ in res), res
    for r, (kind, msg) in enumerate(res):
        assert kind in ("InvalidArgument", "PlaitError"), (r, res[r])
        assert "PLAIT_GLOO_PROBE" in msg and "differs on rank(s)" in msg, msg
