"""Failure paths: dead ranks, late ranks, mismatched and invalid calls, use after finalize.

Every case runs under run_ranks' hard deadline, so a hang fails instead of stalling the suite.
Ranks catch the error themselves and return what they saw (class, message, when), and the
parent asserts the class and the key words of the message on every rank.
"""

import builtins
import os
import re
import resource
import signal
import threading
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks

RUN_TIMEOUT = 60
LOST_WITHIN_S = 5.0  # the contract says about 2 s; allow for a loaded 2-core machine


def outcome(call):
    """Runs call() and describes how it ended."""
    t0 = time.monotonic()
    try:
        result = call()
    except Exception as e:  # noqa: BLE001 - described to the parent
        end = time.monotonic()
        return {
            "exc": type(e).__name__,
            "msg": str(e),
            "t": end - t0,
            "at": end,
            "plait": isinstance(e, plait.PlaitError),
            "value_error": isinstance(e, ValueError),
            "builtin_timeout": isinstance(e, builtins.TimeoutError),
        }
    return {"exc": None, "msg": "returned %r" % (type(result),), "t": time.monotonic() - t0}


def names_rank(msg, r):
    """Whether msg names rank r ("rank 1", "ranks [0, 1]", "peer 1", "rank=1", ...)."""
    # The message proper: the flight report appended to it names every rank.
    msg = msg.split("\nflight recorder", 1)[0]
    return re.search(r"\b(?:ranks?|peers?)\b[^.;\n]*?\b%d\b" % r, msg, re.I) is not None


def expect(res, rank, cls, *patterns):
    """res (from outcome) is cls from plait and its message matches every regex in patterns."""
    assert res["exc"] == cls.__name__ and res["plait"], "rank %d: want plait.%s, got %s: %s" % (
        rank,
        cls.__name__,
        res["exc"],
        res["msg"],
    )
    for pat in patterns:
        assert re.search(pat, res["msg"], re.I), "rank %d: %s message lacks %r: %s" % (
            rank,
            cls.__name__,
            pat,
            res["msg"],
        )


def _init(rank, n, store, **kw):
    comm = plait.init(rank, n, store=store, **kw)
    comm.barrier()  # everyone is up before the interesting part starts
    return comm


def _die(stamp):
    with open(stamp, "w") as f:
        f.write(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)


def _read_stamp(stamp):
    with open(stamp) as f:
        return float(f.read())


# ---------------------------------------------------------------- a rank dies


def _killed_in_allreduce(rank, n, store, stamp, during, victim):
    comm = _init(rank, n, store, timeout=30, buffer_bytes=64 << 10)
    x = np.ones(4 << 20, np.float32)  # 16 MiB: many chunks of the 64 KiB staging buffer
    comm.allreduce(x)
    if rank == victim:
        if not during:
            _die(stamp)
        threading.Timer(0.05, _die, args=(stamp,)).start()

    def until_error():
        for _ in range(10_000):
            comm.allreduce(x)

    res = outcome(until_error if during else (lambda: comm.allreduce(x)))
    res["later"] = outcome(lambda: comm.allreduce(x[:16]))
    return res


@pytest.mark.parametrize("victim", [1, 0], ids=["rank1_dies", "rank0_dies"])
@pytest.mark.parametrize("during", [False, True], ids=["before", "during"])
@pytest.mark.parametrize("n", [2, 3], ids=lambda n: "n%d" % n)
def test_rank_killed_in_allreduce(n, during, victim, tmp_path):
    """A rank SIGKILLed just before or in the middle of a large allreduce: the others raise
    PeerLostError naming it, the call and its sequence number within about 2 s, and later
    calls say the communicator is aborted. Rank 0 created the shared segment, so its death
    also checks that nothing is left in /dev/shm (run_ranks sweeps and checks)."""
    stamp = str(tmp_path / "killed_at")
    results = run_ranks(
        _killed_in_allreduce, n, timeout=RUN_TIMEOUT, args=(stamp, during, victim), may_die={victim}
    )
    killed_at = _read_stamp(stamp)
    for rank, res in enumerate(results):
        if rank == victim:
            assert res is None, "rank %d was meant to die" % victim
            continue
        expect(res, rank, plait.PeerLostError, r"allreduce\b\D{0,12}\d+")  # and its number
        assert names_rank(res["msg"], victim), "rank %d: message does not name rank %d: %s" % (
            rank,
            victim,
            res["msg"],
        )
        lag = res["at"] - killed_at
        assert lag < LOST_WITHIN_S, "rank %d noticed the death after %.2f s" % (rank, lag)
        later = res["later"]
        assert later["plait"] and "abort" in later["msg"].lower(), (
            "rank %d: a call after the abort gave %s: %s" % (rank, later["exc"], later["msg"])
        )


def _killed_with_handles_outstanding(rank, n, store, stamp):
    comm = _init(rank, n, store, timeout=30, buffer_bytes=64 << 10)
    if rank == 1:
        time.sleep(0.2)
        _die(stamp)
    xs = [np.ones(1 << 20, np.float32) for _ in range(3)]
    hs = [comm.allreduce(x, out=x, async_op=True) for x in xs]
    return [outcome(h.wait) for h in reversed(hs)]


def test_rank_killed_with_handles_outstanding(tmp_path):
    """Every outstanding handle raises PeerLostError when a peer dies (none hangs)."""
    stamp = str(tmp_path / "killed_at")
    results = run_ranks(_killed_with_handles_outstanding, 3, timeout=RUN_TIMEOUT, args=(stamp,), may_die={1})
    killed_at = _read_stamp(stamp)
    for rank in (0, 2):
        for res in results[rank]:
            assert res["plait"], "rank %d: wait() gave %s: %s" % (rank, res["exc"], res["msg"])
            assert "PeerLostError" == res["exc"] or "abort" in res["msg"], "rank %d: wait() gave %s: %s" % (
                rank,
                res["exc"],
                res["msg"],
            )
            assert names_rank(res["msg"], 1), res["msg"]
            assert res["at"] - killed_at < LOST_WITHIN_S


def _killed_in_barrier(rank, n, store, stamp):
    comm = _init(rank, n, store, timeout=30)
    if rank == 1:
        time.sleep(0.3)  # the others are in the barrier by now
        _die(stamp)
    return outcome(comm.barrier)


def test_rank_killed_in_barrier(tmp_path):
    stamp = str(tmp_path / "killed_at")
    results = run_ranks(_killed_in_barrier, 3, timeout=RUN_TIMEOUT, args=(stamp,), may_die={1})
    killed_at = _read_stamp(stamp)
    for rank in (0, 2):
        res = results[rank]
        expect(res, rank, plait.PeerLostError, r"barrier\b\D{0,12}\d+")
        assert names_rank(res["msg"], 1), "rank %d: message does not name rank 1: %s" % (rank, res["msg"])
        assert res["at"] - killed_at < LOST_WITHIN_S, "rank %d noticed the death after %.2f s" % (
            rank,
            res["at"] - killed_at,
        )


def _killed_while_peer_receives(rank, n, store, stamp):
    comm = _init(rank, n, store, timeout=30)
    if rank == 1:
        time.sleep(0.3)
        _die(stamp)
    return outcome(lambda: comm.recv(np.empty(1000, np.float32), 1))


def test_rank_killed_while_peer_receives(tmp_path):
    stamp = str(tmp_path / "killed_at")
    results = run_ranks(_killed_while_peer_receives, 2, timeout=RUN_TIMEOUT, args=(stamp,), may_die={1})
    res = results[0]
    expect(res, 0, plait.PeerLostError)
    assert names_rank(res["msg"], 1), "message does not name rank 1: %s" % res["msg"]
    assert res["at"] - _read_stamp(stamp) < LOST_WITHIN_S


# ---------------------------------------------------------------- a rank is late


def _late_rank(rank, n, store, per_call):
    comm = _init(rank, n, store, timeout=30 if per_call else 1.0)
    if rank == 1:
        time.sleep(2.5)
    kw = {"timeout": 1.0} if per_call else {}
    return outcome(lambda: comm.allreduce(np.ones(1000, np.float32), **kw))


@pytest.mark.parametrize("per_call", [False, True], ids=["init_timeout", "call_timeout"])
def test_late_rank_times_out(per_call):
    results = run_ranks(_late_rank, 3, timeout=RUN_TIMEOUT, args=(per_call,))
    for rank in (0, 2):
        res = results[rank]
        expect(res, rank, plait.TimeoutError)
        assert res["builtin_timeout"], "rank %d: not a builtin TimeoutError" % rank
        assert names_rank(res["msg"], 1), "rank %d: message does not name rank 1: %s" % (rank, res["msg"])
        assert 0.9 <= res["t"] < 2.4, "rank %d gave up after %.2f s (timeout 1.0 s)" % (rank, res["t"])
    assert results[1]["plait"], "the late rank got %s: %s" % (results[1]["exc"], results[1]["msg"])


def _zero_timeout(rank, n, store):
    comm = _init(rank, n, store, timeout=30)
    if rank == 1:
        time.sleep(2.0)  # still alive, and late
        return outcome(lambda: comm.allreduce(np.ones(1000, np.float32)))
    return outcome(lambda: comm.allreduce(np.ones(1000, np.float32), timeout=0))


def test_zero_timeout_polls_once():
    """timeout=0 is a deadline that has passed when the call starts: with a peer missing the call
    fails at once instead of waiting for the communicator's default (as 0 used to mean)."""
    results = run_ranks(_zero_timeout, 3, timeout=RUN_TIMEOUT)
    for rank in (0, 2):
        expect(results[rank], rank, plait.TimeoutError, r"after 0 s")
        assert names_rank(results[rank]["msg"], 1), results[rank]["msg"]
        assert results[rank]["t"] < 1.0, "rank %d waited %.2f s with timeout=0" % (rank, results[rank]["t"])
    assert results[1]["plait"], "the late rank got %s: %s" % (results[1]["exc"], results[1]["msg"])


_BAD_SECONDS = {
    "nan": float("nan"),
    "negative": -1,
    "-inf": float("-inf"),
    "str": "5",
    "bool": True,
    "list": [1],
}


def _bad_init_timeouts(rank, n, store):
    """Every rank passes the same bad value, as a job-wide setting would: each must refuse it before
    the rendezvous, at once, and a later valid init must still work."""
    seen = {}
    for name, v in _BAD_SECONDS.items():
        seen["timeout=" + name] = outcome(lambda v=v: plait.init(rank, n, store=store, timeout=v))
        seen["init_timeout=" + name] = outcome(lambda v=v: plait.init(rank, n, store=store, init_timeout=v))
    for text in ("nan", "-1", "abc", "inf-ish"):
        os.environ["PLAIT_TIMEOUT"] = text
        seen["PLAIT_TIMEOUT=" + text] = outcome(lambda: plait.init(rank, n, store=store))
    del os.environ["PLAIT_TIMEOUT"]
    for res in seen.values():
        if res["exc"] is None:
            plait.finalize()  # the unfixed build accepted it: keep the ranks in step
    comm = plait.init(rank, n, store=store, timeout=10)
    seen["later init works"] = float(comm.allreduce(np.ones(4, np.float32))[0]) == n
    return seen


def test_bad_timeouts_at_init_are_refused():
    for rank, seen in enumerate(run_ranks(_bad_init_timeouts, 2, timeout=RUN_TIMEOUT)):
        assert seen.pop("later init works") is True
        for what, res in seen.items():
            pat = r"PLAIT_TIMEOUT" if what.startswith("PLAIT") else what.split("=")[0]
            expect(res, rank, plait.InvalidArgument, pat)
            assert res["t"] < 1.0, "rank %d: %s took %.2f s to refuse" % (rank, what, res["t"])


def _handle_wait_timeouts(rank, n, store):
    comm = _init(rank, n, store, timeout=30)
    inf = float("inf")  # no deadline, as asked
    assert comm.allreduce(np.ones(4, np.float32), timeout=inf).tolist() == [2.0] * 4
    if rank == 1:
        time.sleep(1.5)
        return {"result": comm.allreduce(np.full(8, 2.0, np.float32)).tolist()}
    h = comm.allreduce(np.full(8, 2.0, np.float32), async_op=True)
    seen = {name: outcome(lambda v=v: h.wait(timeout=v)) for name, v in _BAD_SECONDS.items()}
    seen["zero"] = outcome(lambda: h.wait(timeout=0))  # the peer is still asleep
    seen["result"] = h.wait(timeout=inf).tolist()  # the call went on meanwhile
    return seen


def test_handle_wait_timeouts():
    results = run_ranks(_handle_wait_timeouts, 2, timeout=RUN_TIMEOUT)
    assert results[1]["result"] == [4.0] * 8
    seen = results[0]
    assert seen.pop("result") == [4.0] * 8
    expect(seen.pop("zero"), 0, plait.TimeoutError, r"still running")
    for res in seen.values():
        expect(res, 0, plait.InvalidArgument, r"timeout")


# ---------------------------------------------------------------- mismatched calls


def _ones(dtype=np.float32, count=16):
    return np.ones(count, dtype)


_A = plait.algorithms("allreduce")
MISMATCHES = {
    # field: (call(comm, culprit), regexes every rank's message must match)
    "count": (lambda c, bad: c.allreduce(_ones(count=17 if bad else 16)), [r"count", r"\b16\b", r"\b17\b"]),
    "dtype": (
        lambda c, bad: c.allreduce(_ones(np.int32 if bad else np.float32)),
        [r"dtype", r"float32", r"int32"],
    ),
    "op": (
        lambda c, bad: c.allreduce(_ones(), op="max" if bad else "sum"),
        [r"\bop\b", r"\bsum\b", r"\bmax\b"],
    ),
    "root": (lambda c, bad: c.broadcast(_ones(), root=2 if bad else 0), [r"root", r"\b0\b", r"\b2\b"]),
    "collective": (
        lambda c, bad: (c.allgather if bad else c.allreduce)(_ones()),
        [r"allreduce", r"allgather"],
    ),
    "algorithm": (
        lambda c, bad: c.allreduce(_ones(), algorithm=_A[-1] if bad else _A[0]),
        [r"algorithm", _A[0], _A[-1]],
    ),
}


def _mismatch(rank, n, store, field):
    comm = _init(rank, n, store, timeout=5.0)
    res = outcome(lambda: MISMATCHES[field][0](comm, rank == 1))
    res["later"] = outcome(comm.barrier)
    return res


def first_error(res, rank, may_finish):
    """The error a rank saw: from the call itself, or (only for a rank allowed to finish the call
    first, like a broadcast root that need not wait for its receivers) from its next call."""
    if res["exc"] is None and may_finish:
        return res["later"]
    assert res["exc"] is not None, "rank %d: the call returned normally" % rank
    return res


@pytest.mark.parametrize("field", list(MISMATCHES))
def test_mismatch(field):
    results = run_ranks(_mismatch, 3, timeout=RUN_TIMEOUT, args=(field,))
    for rank, res in enumerate(results):
        res = first_error(res, rank, may_finish=(field == "root" and rank == 0))
        expect(res, rank, plait.MismatchError, *MISMATCHES[field][1])
        assert names_rank(res["msg"], 1), "rank %d: message does not name rank 1: %s" % (rank, res["msg"])
        assert res["t"] < 4.0, "rank %d took %.2f s to see the mismatch" % (rank, res["t"])
        if "later" in res:
            assert res["later"]["plait"] and "abort" in res["later"]["msg"], (
                "rank %d: a call after the mismatch gave %s: %s"
                % (rank, res["later"]["exc"], res["later"]["msg"])
            )


def _algo_env_differs(rank, n, store):
    os.environ["PLAIT_ALGO"] = _A[-1] if rank == 1 else _A[0]
    comm = _init(rank, n, store, timeout=5.0)
    return outcome(lambda: comm.allreduce(_ones()))


def test_plait_algo_env_forces_the_algorithm():
    """PLAIT_ALGO really picks the algorithm of an "auto" call: ranks that force different ones
    disagree, and say so."""
    for rank, res in enumerate(run_ranks(_algo_env_differs, 3, timeout=RUN_TIMEOUT)):
        expect(res, rank, plait.MismatchError, r"algorithm", _A[0], _A[-1])


SKIPS = {
    # The culprit (rank 1) leaves out the first call of the sequence.
    "allreduce": [lambda c: c.allreduce(_ones(count=16)), lambda c: c.allreduce(_ones(count=32))],
    "barrier": [lambda c: c.barrier(), lambda c: c.allreduce(_ones())],
    "broadcast": [
        lambda c: c.broadcast(_ones(), root=0),
        lambda c: c.broadcast(_ones(), root=0),
        lambda c: c.barrier(),
    ],
}


def _skip(rank, n, store, which):
    comm = _init(rank, n, store, timeout=2.0)
    calls = SKIPS[which][1:] if rank == 1 else SKIPS[which]
    return outcome(lambda: [call(comm) for call in calls])


@pytest.mark.parametrize("which", list(SKIPS))
def test_rank_skips_a_call(which):
    results = run_ranks(_skip, 3, timeout=RUN_TIMEOUT, args=(which,))
    for rank, res in enumerate(results):
        assert res["plait"] and res["exc"] in ("MismatchError", "TimeoutError"), (
            "rank %d: want MismatchError or TimeoutError, got %s: %s" % (rank, res["exc"], res["msg"])
        )
        assert names_rank(res["msg"], 1), "rank %d: message does not name rank 1: %s" % (rank, res["msg"])


def _never_calls_again(rank, n, store):
    comm = _init(rank, n, store, timeout=1.0)
    if rank == 1:
        time.sleep(3.0)  # alive, but never makes the call
        return None
    return outcome(lambda: comm.allreduce(_ones()))


def test_rank_never_calls_again():
    results = run_ranks(_never_calls_again, 3, timeout=RUN_TIMEOUT)
    for rank in (0, 2):
        expect(results[rank], rank, plait.TimeoutError)
        assert names_rank(results[rank]["msg"], 1), results[rank]["msg"]


# ---------------------------------------------------------------- invalid arguments


def _read_only(count=16):
    out = np.empty(count, np.float32)
    out.flags.writeable = False
    return out


_OVERLAP = np.ones(32, np.float32)


def _fine(c):
    return c.allreduce(_ones())


INVALID = {
    # case: (the culprit's call, what the others call, regex the culprit's message must match)
    "non_contiguous_x": (lambda c: c.allreduce(np.ones(32, np.float32)[::2]), _fine, r"contiguous"),
    "out_wrong_size": (
        lambda c: c.allreduce(_ones(), out=np.empty(15, np.float32)),
        _fine,
        r"out.*\b(60|15)\b",
    ),
    "out_wrong_dtype": (lambda c: c.allreduce(_ones(), out=np.empty(16, np.int32)), _fine, r"dtype|int32"),
    "avg_on_int32": (
        lambda c: c.allreduce(_ones(np.int32), op="avg"),
        lambda c: c.allreduce(_ones(np.int32)),
        r"avg",
    ),
    "unknown_op": (lambda c: c.allreduce(_ones(), op="mean"), _fine, r"mean"),
    "unknown_algorithm": (lambda c: c.allreduce(_ones(), algorithm="bogus"), _fine, r"bogus"),
    "root_out_of_range": (
        lambda c: c.broadcast(_ones(), root=c.size),
        lambda c: c.broadcast(_ones(), root=0),
        r"root",
    ),
    "read_only_out": (lambda c: c.allreduce(_ones(), out=_read_only()), _fine, r"read.?only|writ"),
    "complex64": (lambda c: c.allreduce(np.ones(16, np.complex64)), _fine, r"complex64|dtype"),
    "overlapping_out": (lambda c: c.allreduce(_OVERLAP[:16], out=_OVERLAP[8:24]), _fine, r"overlap"),
    "alltoall_indivisible": (
        lambda c: c.alltoall(_ones(count=3 * c.size + 1)),
        lambda c: c.alltoall(_ones(count=3 * c.size)),
        r"block|size|divis",
    ),
    "big_endian_float32": (lambda c: c.allreduce(_ones(">f4")), _fine, r"byte.?order|endian|>f4"),
    "peer_out_of_range": (lambda c: c.send(_ones(), c.size + 2), lambda c: c.barrier(), r"peer"),
    "reduce_scatter_indivisible": (
        lambda c: c.reduce_scatter(_ones(count=16 + 1)),
        lambda c: c.reduce_scatter(_ones(count=15)),
        r"input|size|count",
    ),
    # A timeout that is no number of seconds >= 0 used to mean the default deadline (or none).
    "timeout_negative": (lambda c: c.allreduce(_ones(), timeout=-1), _fine, r"timeout.*-1"),
    "timeout_nan": (lambda c: c.allreduce(_ones(), timeout=float("nan")), _fine, r"timeout.*nan"),
    "timeout_not_a_number": (lambda c: c.allreduce(_ones(), timeout="5"), _fine, r"timeout.*str"),
    "timeout_nan_async_barrier": (
        lambda c: c.barrier(timeout=float("nan"), async_op=True),
        lambda c: c.barrier(),
        r"timeout.*nan",
    ),
    "timeout_negative_send": (
        lambda c: c.send(_ones(), 0, timeout=-0.5),
        lambda c: c.barrier(),
        r"timeout.*-0\.5",
    ),
}


def _invalid(rank, n, store, case):
    comm = _init(rank, n, store, timeout=6.0)
    bad, fine, _ = INVALID[case]
    res = outcome(lambda: (bad if rank == 1 else fine)(comm))
    res["later"] = outcome(comm.barrier)
    return res


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_argument(case):
    results = run_ranks(_invalid, 3, timeout=RUN_TIMEOUT, args=(case,))
    res = results[1]
    expect(res, 1, plait.InvalidArgument, INVALID[case][2])
    assert res["value_error"], "InvalidArgument is not a ValueError"
    for rank in (0, 2):
        # The contract: the call aborts everywhere, and the ranks that did nothing wrong raise
        # the same class naming the rank at fault, well before their own timeout (6 s).
        res = first_error(results[rank], rank, may_finish=(case == "root_out_of_range" and rank == 0))
        expect(res, rank, plait.InvalidArgument)
        assert names_rank(res["msg"], 1), "rank %d: message does not name rank 1: %s" % (rank, res["msg"])
        assert res["t"] < 3.0, "rank %d heard of the error after %.2f s" % (rank, res["t"])


P2P_MISMATCHES = {
    # what rank 1's recv differs in: (rank 1's recv, regexes its message must match)
    "size": (lambda c: c.recv(np.empty(17, np.float32), 0, tag=3), [r"\b68\b", r"\b64\b"]),
    "tag": (lambda c: c.recv(np.empty(16, np.float32), 0, tag=4), [r"tag\W*3", r"tag\W*4"]),
    "dtype": (lambda c: c.recv(np.empty(16, np.int32), 0, tag=3), [r"float32", r"int32"]),
}


def _p2p_mismatch(rank, n, store, field):
    comm = _init(rank, n, store, timeout=5.0)
    if rank == 0:
        # A send may complete before the receiver looks at it; then the error comes later.
        res = outcome(lambda: comm.send(np.ones(16, np.float32), 1, tag=3))
        res["later"] = outcome(comm.barrier)
        return res
    res = outcome(lambda: P2P_MISMATCHES[field][0](comm))
    res["later"] = outcome(comm.barrier)
    return res


@pytest.mark.parametrize("field", list(P2P_MISMATCHES))
def test_send_recv_mismatch(field):
    results = run_ranks(_p2p_mismatch, 2, timeout=RUN_TIMEOUT, args=(field,))
    expect(results[1], 1, plait.MismatchError, *P2P_MISMATCHES[field][1])
    sender = first_error(results[0], 0, may_finish=True)
    assert sender["plait"], "the sender got %s: %s" % (sender["exc"], sender["msg"])


# ---------------------------------------------------------------- after finalize


def _after_finalize(rank, n, store):
    comm = _init(rank, n, store, timeout=10)
    comm.finalize()
    return {
        "allreduce": outcome(lambda: comm.allreduce(_ones())),
        "barrier": outcome(comm.barrier),
        "module allreduce": outcome(lambda: plait.allreduce(_ones())),
    }


def _after_with_block(rank, n, store):
    with plait.init(rank, n, store=store, timeout=10) as comm:
        comm.barrier()
    return {"allreduce": outcome(lambda: comm.allreduce(_ones())), "split": outcome(lambda: comm.split(0))}


@pytest.mark.parametrize("worker", [_after_finalize, _after_with_block], ids=["finalize", "with_block"])
def test_calls_after_finalize_raise(worker):
    for rank, calls in enumerate(run_ranks(worker, 2, timeout=RUN_TIMEOUT)):
        for what, res in calls.items():
            assert res["plait"], "rank %d: %s after finalize gave %s: %s" % (
                rank,
                what,
                res["exc"],
                res["msg"],
            )
            assert res["t"] < 2.0, "rank %d: %s after finalize took %.2f s" % (rank, what, res["t"])


# ---------------------------------------------------------------- /dev/shm too small


def _shm_too_big(rank, n, store, buffer_bytes):
    # Caps what a library that skipped the check could write into tmpfs (RAM) at 4 GiB a file:
    # past it ftruncate/fallocate fail with EFBIG instead of filling the machine's memory.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 30, hard))
    return outcome(lambda: plait.init(rank, n, store=store, timeout=5, buffer_bytes=buffer_bytes))


def _more_than_dev_shm_holds():
    st = os.statvfs("/dev/shm")
    return max(1 << 40, 2 * st.f_blocks * st.f_frsize)


def test_dev_shm_too_small_says_how_much():
    buffer_bytes = _more_than_dev_shm_holds()
    res = run_ranks(_shm_too_big, 1, timeout=RUN_TIMEOUT, args=(buffer_bytes,))[0]
    assert res["plait"], "init with buffer_bytes=%d gave %s: %s" % (buffer_bytes, res["exc"], res["msg"])
    msg = res["msg"]
    assert (
        "/dev/shm" in msg and re.search(r"need|requir", msg, re.I) and re.search(r"avail|free", msg, re.I)
    ), "the error does not say what is needed and available: " + msg
    assert len(re.findall(r"\d{4,}", msg)) >= 2, "the error gives no sizes: " + msg


def test_dev_shm_too_small_fails_every_rank_promptly():
    """Rank 0 sizes the segment; the others must hear that it failed, not wait out the store."""
    results = run_ranks(_shm_too_big, 3, timeout=15, args=(_more_than_dev_shm_holds(),))
    for rank, res in enumerate(results):
        assert res["plait"], "rank %d: %s: %s" % (rank, res["exc"], res["msg"])
        assert res["t"] < 10, "rank %d failed only after %.1f s" % (rank, res["t"])


# ---------------------------------------------------------------- deadlines across simulated hosts


def _hier_timeouts(rank, n, store):
    os.environ["PLAIT_HOST_ID"] = "host%d" % (rank % 2)
    comm = plait.init(rank, n, store=store, timeout=10)
    seen = {"hier": type(comm).__name__}
    h = comm.allreduce(np.ones(4, np.float32), async_op=True)
    seen["wait inf"] = h.wait(timeout=float("inf")).tolist()
    seen["wait nan"] = outcome(lambda: h.wait(timeout=float("nan")))
    bad = rank == 1
    seen["call"] = outcome(lambda: comm.allreduce(np.ones(4, np.float32), timeout=-2 if bad else None))
    return seen


def test_bad_timeout_aborts_every_host():
    for rank, seen in enumerate(run_ranks(_hier_timeouts, 4, timeout=RUN_TIMEOUT)):
        assert seen["hier"] == "HierCommunicator"
        assert seen["wait inf"] == [4.0] * 4
        expect(seen["wait nan"], rank, plait.InvalidArgument, r"timeout.*nan")
        expect(seen["call"], rank, plait.InvalidArgument, r"rank 1: allreduce: timeout.*-2")
        assert seen["call"]["t"] < 3.0, "rank %d heard after %.2f s" % (rank, seen["call"]["t"])


def _fail_on_rank_1(rank, n, store, kind):
    comm = _init(rank, n, store)
    if rank == 1:
        bad = outcome(lambda: comm.fail("rank 1: a layer above refused this call", "nonsense"))
        first = outcome(lambda: comm.fail("rank 1: a layer above refused this call", kind))
        return bad, first, outcome(lambda: comm.barrier())
    return None, outcome(lambda: comm.allreduce(np.ones(4, np.float32))), outcome(lambda: comm.barrier())


@pytest.mark.parametrize("kind, cls", [("invalid", plait.InvalidArgument), ("mismatch", plait.MismatchError)])
def test_fail_aborts_every_rank(kind, cls):
    # Communicator.fail is how the GPU and multi-host layers reject input: the rank that calls it
    # raises the error, every peer gets it from the call it waits in, and the communicator is dead.
    results = run_ranks(_fail_on_rank_1, 3, args=(kind,), timeout=RUN_TIMEOUT)
    bad = results[1][0]
    expect(bad, 1, plait.InvalidArgument, "kind must be")
    for r, (_, first, after) in enumerate(results):
        expect(first, r, cls, "a layer above refused")
        assert after["exc"] and after["plait"], (r, after)
