"""The gloo engine (csrc/torch/gloo_engine.cc) on its own: every function of hier/engine.h over a
ProcessGroupGloo, called through the native torch module's test-only _engine_* calls on numpy
arrays, on 2 and 3 ranks, with exact integer-valued data; timeouts, fail() and a killed rank."""

import os
import signal
import threading
import time
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch._C._distributed_c10d import FileStore, PrefixStore, ProcessGroupGloo  # noqa: E402

import plait  # noqa: E402
from plait import _C  # noqa: E402
from plait.torch import _native  # noqa: E402

INF = float("inf")
DTYPES = {  # plait code -> numpy type the test keeps its values in (bfloat16 as its bits)
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "float64": np.float64,
    "int8": np.int8,
    "uint8": np.uint8,
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.bool_,
}
CODES = {name: i for i, name in enumerate(DTYPES)}  # capi.h's plait_dtype order
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3}


def _setup(rank, n, store_dir, label="t", timeout=30):
    """(module, engine capsule, c10d store) for this rank."""
    mod = _native.load()
    store = FileStore(os.path.join(store_dir, "store"), n)
    opts = ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout)
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = ProcessGroupGloo(PrefixStore("gloo/" + label, store), rank, n, opts)
    eng = mod.make_gloo_engine(pg, PrefixStore("job", store), label)
    return mod, eng, store


def _as(values, name):
    """Integer-valued float64 values as the dtype's array (bfloat16: the float32's top 16 bits)."""
    if name == "bfloat16":
        return (np.asarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.asarray(values).astype(DTYPES[name])


def _expected(name, op, n, count):
    """The closed form of op over ranks r of x_r[i] = _value(r, i)."""
    vals = np.array([[_value(r, i, name) for i in range(count)] for r in range(n)], dtype=np.float64)
    if name == "bool":
        vals = vals != 0
        red = vals.any(0) if op in ("sum", "max") else vals.all(0)
        return red.astype(np.bool_)
    red = {"sum": vals.sum(0), "prod": vals.prod(0), "min": vals.min(0), "max": vals.max(0)}[op]
    return _as(red, name)


def _value(r, i, name):
    if name == "bool":
        return (r + i) % 3 != 0
    return (r + 1) * (i % 3) + (1 if name.startswith("u") else -1) * (i % 2)


def _ops(rank, n, _addr, store_dir):
    mod, eng, _ = _setup(rank, n, store_dir)
    try:
        assert mod._engine_info(eng) == ("gloo", rank, n)
        count = 7
        for name in DTYPES:
            for op in OPS:
                assert mod._engine_supports(eng, CODES[name], OPS[op]), (name, op)
                a = _as([_value(rank, i, name) for i in range(count)], name)
                mod._engine_allreduce(eng, a, CODES[name], OPS[op], 30.0)
                want = _expected(name, op, n, count)
                assert np.array_equal(a, want), (name, op, a, want)
                assert a.tobytes() == want.tobytes(), (name, op)  # bools: bytes 0 and 1 only
        assert not mod._engine_supports(eng, CODES["float32"], 4)  # avg is never native
        assert not mod._engine_supports(eng, 9, 0)
        for bytes_ in (1, 13, 1 << 16):
            mine = ((np.arange(bytes_) + 31 * rank) % 251).astype(np.uint8)
            out = np.zeros(n * bytes_, np.uint8)
            mod._engine_allgather(eng, mine, out, 30.0)
            assert np.array_equal(out, np.concatenate([(np.arange(bytes_) + 31 * r) % 251 for r in range(n)]))
            out2 = np.zeros_like(out)
            req = mod._engine_allgather_start(eng, mine, out2)
            mod._engine_wait(eng, req, 30.0)
            assert np.array_equal(out2, out)
            b = mine.copy()
            mod._engine_broadcast(eng, b, n - 1, 30.0)
            assert np.array_equal(b, (np.arange(bytes_) + 31 * (n - 1)) % 251)
            j, k = np.arange(n)[:, None], np.arange(bytes_)[None, :]
            blocks = ((100 * rank + 10 * j + k) % 256).astype(np.uint8)  # block j goes to rank j
            got = np.zeros_like(blocks)
            mod._engine_alltoall(eng, blocks, got, 30.0)
            assert np.array_equal(got, (100 * j + 10 * rank + k) % 256)
        # A ring of send/recv, two messages per (peer, tag) arriving in order, a second tag apart.
        right, left = (rank + 1) % n, (rank - 1) % n
        msgs = [np.full(5, 10 * rank + k, np.int64) for k in range(3)]
        got = [np.zeros(5, np.int64) for _ in range(3)]
        tags = (7, 7, 9)
        for step in ("send", "recv") if rank % 2 == 0 else ("recv", "send"):
            for k in range(3):
                if step == "send":
                    mod._engine_send(eng, msgs[k], right, tags[k], 30.0)
                else:
                    mod._engine_recv(eng, got[k], left, tags[k], 30.0)
        assert [g.tolist() for g in got] == [[10 * left + k] * 5 for k in range(3)]
        with pytest.raises(plait.InvalidArgument, match="root 5 is not a member"):
            mod._engine_broadcast(eng, np.zeros(2, np.uint8), 5, 30.0)
        with pytest.raises(plait.InvalidArgument, match="another member"):
            mod._engine_send(eng, np.zeros(2, np.uint8), rank, 0, 30.0)
        mod._engine_allreduce(eng, np.zeros(0, np.float32), CODES["float32"], 0, 30.0)  # nothing to do
        return True
    finally:
        mod._engine_release(eng)


@pytest.mark.parametrize("n", [2, 3])
def test_every_op_and_dtype(ranks, tmp_path, n):
    assert ranks(_ops, n, timeout=180, args=(str(tmp_path),)) == [True] * n


def _timeouts(rank, n, _addr, store_dir):
    mod, eng, store = _setup(rank, n, store_dir)
    try:
        if rank == 1:  # joins nothing until rank 0 is done
            store.wait(["done"], timedelta(seconds=60))
            return None
        t0 = time.monotonic()
        with pytest.raises(plait.TimeoutError, match=r"gloo allreduce of 3 int32 \(sum\) on group 't'"):
            mod._engine_allreduce(eng, np.ones(3, np.int32), CODES["int32"], 0, 0.5)
        took = time.monotonic() - t0
        # The group is unusable after a timeout: the next call says so at once.
        t1 = time.monotonic()
        with pytest.raises(plait.TimeoutError, match="timed out: the group is unusable"):
            mod._engine_broadcast(eng, np.ones(3, np.uint8), 0, 5.0)
        again = time.monotonic() - t1
        store.set("done", b"1")
        return took, again
    finally:
        mod._engine_release(eng)


def test_timeout_raises_timeout_error(ranks, tmp_path):
    took, again = ranks(_timeouts, 2, timeout=90, args=(str(tmp_path),))[0]
    assert 0.5 <= took < 3.0, took  # the deadline, then gloo's own end of the op (0.1 s later)
    assert again < 0.5, again


def _recv_timeout(rank, n, _addr, store_dir):
    mod, eng, store = _setup(rank, n, store_dir)
    try:
        if rank == 0:
            t0 = time.monotonic()
            with pytest.raises(plait.TimeoutError, match="recv of 8 B from 1"):
                mod._engine_recv(eng, np.zeros(8, np.uint8), 1, 3, 0.4)
            store.set("done", b"1")
            return time.monotonic() - t0
        store.wait(["done"], timedelta(seconds=60))
        return None
    finally:
        mod._engine_release(eng)


def test_recv_timeout(ranks, tmp_path):
    took = ranks(_recv_timeout, 2, timeout=90, args=(str(tmp_path),))[0]
    assert 0.4 <= took < 3.0, took


def _fail(rank, n, _addr, store_dir):
    """rank 0 fails (a mismatch) while ranks 1 and 2 wait in an allreduce; rank 1 fails too,
    later. Every call ends with the first failure's kind and message."""
    mod, eng, store = _setup(rank, n, store_dir)
    try:
        if rank == 0:
            time.sleep(0.5)
            mod._engine_fail(eng, 3, "first failure")  # a mismatch: every rank raises its class
            with pytest.raises(plait.MismatchError, match="rank 0 failed: first failure"):
                mod._engine_allreduce(eng, np.ones(2, np.float32), CODES["float32"], 0, 30.0)
            store.add("finished", 1)
            return None
        later = threading.Timer(1.0, mod._engine_fail, (eng, 1, "second failure"))
        if rank == 1:
            later.start()
        t0 = time.monotonic()
        with pytest.raises(plait.MismatchError) as info:
            mod._engine_allreduce(eng, np.ones(2, np.float32), CODES["float32"], 0, 30.0)
        took = time.monotonic() - t0
        if rank == 1:
            later.join()
        store.add("finished", 1)
        while store.add("finished", 0) < n:
            time.sleep(0.01)
        return took, str(info.value), store.get("job/plait/engine-abort/msg").decode()
    finally:
        mod._engine_release(eng)


def test_fail_ends_calls_everywhere(ranks, tmp_path):
    _, one, two = ranks(_fail, 3, timeout=90, args=(str(tmp_path),))
    for took, msg, flag in (one, two):
        # The flag ended the waiting calls within ~1 s of rank 0's fail() (0.5 s in).
        assert took < 0.5 + 1.0, (took, msg)
        assert "rank 0 failed: first failure" in msg and "second" not in msg, msg
        assert flag == "3|rank 0 failed: first failure", flag  # the first failure's kind and text
    assert "gloo allreduce of 2 float32 (sum) on group 't' (rank 2 of 3)" in two[1], two[1]


def _fail_own_call(rank, n, _addr, store_dir):
    """fail() from another thread ends this rank's own waiting call at once."""
    mod, eng, store = _setup(rank, n, store_dir)
    try:
        if rank == 1:
            store.wait(["done"], timedelta(seconds=60))
            return None
        threading.Timer(0.3, mod._engine_fail, (eng, 2, "bad argument here")).start()
        t0 = time.monotonic()
        with pytest.raises(plait.InvalidArgument, match="rank 0 failed: bad argument here"):
            mod._engine_allreduce(eng, np.ones(2, np.int64), CODES["int64"], 0, 30.0)
        store.set("done", b"1")
        return time.monotonic() - t0
    finally:
        mod._engine_release(eng)


def test_fail_ends_own_waiting_call(ranks, tmp_path):
    took = ranks(_fail_own_call, 2, timeout=90, args=(str(tmp_path),))[0]
    assert 0.3 <= took < 0.6, took


def _killed(rank, n, _addr, store_dir):
    mod, eng, store = _setup(rank, n, store_dir)
    store.add("ready", 1)
    store.wait(["ready"], timedelta(seconds=60))
    while store.add("ready", 0) < n:
        time.sleep(0.01)
    if rank == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    t0 = time.monotonic()
    try:
        with pytest.raises(plait.PeerLostError, match="gloo allreduce"):
            a = np.ones(1 << 12, np.float32)
            for _ in range(1000):  # until the dead rank is missed
                mod._engine_allreduce(eng, a, CODES["float32"], 0, 60.0)
        took = time.monotonic() - t0
        with pytest.raises(plait.PeerLostError):  # and the group stays dead
            mod._engine_broadcast(eng, np.ones(3, np.uint8), 0, 5.0)
        return took
    finally:
        mod._engine_release(eng)


def test_killed_rank_is_peer_lost(ranks, tmp_path):
    got = ranks(_killed, 3, timeout=120, args=(str(tmp_path),), may_die=(2,))
    assert got[2] is None
    for took in got[:2]:
        assert took < 10.0, got


def test_capsule_is_an_engine_table():
    mod = _native.load()
    assert _C is not None and hasattr(mod, "make_gloo_engine")
    with pytest.raises(ValueError, match="not an engine capsule"):
        mod._engine_info(_C._capi)


def _started(rank, n, _addr, store_dir):
    """allreduce_start: several in flight at once, each waited in turn, exact in every dtype."""
    mod, eng, _ = _setup(rank, n, store_dir)
    try:
        bufs, reqs = [], []
        for name in DTYPES:
            for op in ("sum", "max"):
                for count in (1, 7, 1 << 14):
                    a = _as([_value(rank, i, name) for i in range(count)], name)
                    reqs.append(mod._engine_allreduce_start(eng, a, CODES[name], OPS[op], 30.0))
                    bufs.append((name, op, count, a))
        for req, (name, op, count, a) in zip(reqs, bufs):
            mod._engine_wait(eng, req, 30.0)
            assert a.tobytes() == _expected(name, op, n, count).tobytes(), (name, op, count)
        none = np.zeros(0, np.int32)
        mod._engine_wait(eng, mod._engine_allreduce_start(eng, none, CODES["int32"], 0, 30.0), 30.0)
        with pytest.raises(plait.InvalidArgument, match="not one gloo reduces"):
            mod._engine_allreduce_start(eng, np.ones(2, np.float32), CODES["float32"], 4, 30.0)
        return len(reqs)
    finally:
        mod._engine_release(eng)


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_start_in_flight_together(ranks, tmp_path, n):
    assert ranks(_started, n, timeout=180, args=(str(tmp_path),)) == [54] * n


def _started_ends(rank, n, _addr, store_dir, how):
    """A started allreduce that its peer never joins: wait's deadline, or fail() from another
    thread, ends it with its kind; the group refuses later starts."""
    mod, eng, store = _setup(rank, n, store_dir)
    try:
        if rank == 1:
            store.wait(["done"], timedelta(seconds=60))
            return None
        a = np.ones(16, np.int64)
        limit = 0.4 if how == "deadline" else 30.0  # gloo's own timeout follows the call's
        req = mod._engine_allreduce_start(eng, a, CODES["int64"], 0, limit)
        t0 = time.monotonic()  # before the timer starts: its 0.3 s are inside took
        if how == "fail":
            threading.Timer(0.3, mod._engine_fail, (eng, 3, "mismatch elsewhere")).start()
        want = plait.TimeoutError if how == "deadline" else plait.MismatchError
        with pytest.raises(want, match="gloo allreduce of 16 int64"):
            mod._engine_wait(eng, req, limit)
        took = time.monotonic() - t0
        with pytest.raises(want):
            mod._engine_allreduce_start(eng, a, CODES["int64"], 0, 30.0)
        store.set("done", b"1")
        return took
    finally:
        mod._engine_release(eng)


@pytest.mark.parametrize("how", ["deadline", "fail"])
def test_allreduce_start_ends_on_deadline_or_fail(ranks, tmp_path, how):
    took = ranks(_started_ends, 2, timeout=90, args=(str(tmp_path), how))[0]
    assert 0.3 <= took < 3.0, took


def _probe(rank, n, _addr, store_dir):
    """probe(tag) over the engine's headers: nothing before anyone sent; then each sender's
    message (inline, zero-byte and past the header's room) with its source and size, received by
    name from that source; another tag unseen; the headers' reserved tag refused."""
    mod, eng, store = _setup(rank, n, store_dir)
    try:
        assert mod._engine_probe(eng, 4) == (-1, 0)
        mod._engine_allreduce(eng, np.zeros(1, np.float32), CODES["float32"], 0, 30.0)  # all probed
        checks = 1
        if rank:
            mod._engine_send(eng, np.full(2, rank, np.int64), 0, 4, 30.0)
            mod._engine_send(eng, np.zeros(0, np.int64), 0, 5, 30.0)
            mod._engine_send(eng, np.arange(250, dtype=np.int32) + 1000 * rank, 0, 6, 30.0)
        else:
            for tag, want in ((4, 16), (5, 0), (6, 1000)):
                seen = []
                for _ in range(n - 1):
                    deadline = time.monotonic() + 30
                    while (got := mod._engine_probe(eng, tag))[0] < 0:
                        assert mod._engine_probe(eng, 9) == (-1, 0)
                        assert time.monotonic() < deadline, f"nothing of tag {tag}"
                        time.sleep(0.001)
                    src, size = got
                    assert size == want, (tag, got)
                    out = np.zeros(want // 4, np.int32)
                    mod._engine_recv(eng, out, src, tag, 30.0)
                    expect = {
                        4: np.full(2, src, np.int64).view(np.int32),
                        5: [],
                        6: np.arange(250) + 1000 * src,
                    }
                    assert out.tolist() == list(expect[tag]), (tag, src, out[:4])
                    seen.append(src)
                    checks += 1
                assert sorted(seen) == list(range(1, n)), seen
            with pytest.raises(plait.InvalidArgument, match="2\\^31 - 1"):
                mod._engine_probe(eng, 2**31 - 1)
            with pytest.raises(plait.InvalidArgument, match="carries the engine's message headers"):
                mod._engine_send(eng, np.zeros(1, np.uint8), 1, 2**31 - 1, 30.0)
            checks += 2
        mod._engine_allreduce(eng, np.zeros(1, np.float32), CODES["float32"], 0, 30.0)
        return checks
    finally:
        mod._engine_release(eng)


@pytest.mark.parametrize("n", [2, 3])
def test_probe_finds_each_sender_once(ranks, tmp_path, n):
    assert ranks(_probe, n, timeout=120, args=(str(tmp_path),)) == [3 + 3 * (n - 1)] + [1] * (n - 1)


def _recv_mismatch(rank, n, _addr, store_dir):
    mod, eng, _ = _setup(rank, n, store_dir)
    try:
        if rank == 1:
            mod._engine_send(eng, np.arange(3, dtype=np.int64), 0, 2, 30.0)  # 24 bytes, inline
            return None
        with pytest.raises(plait.MismatchError, match="member 1 sent 24 B on this tag"):
            mod._engine_recv(eng, np.zeros(4, np.int64), 1, 2, 30.0)
        return True
    finally:
        mod._engine_release(eng)


def test_recv_of_another_size_is_a_mismatch(ranks, tmp_path):
    assert ranks(_recv_mismatch, 2, timeout=60, args=(str(tmp_path),)) == [True, None]


def _recv_from_killed(rank, n, _addr, store_dir):
    """A recv (and a probe) waiting on the inbox for a member that dies: PeerLostError once its
    connection closes, long before the 60 s deadline; a recv from a live member still works."""
    mod, eng, store = _setup(rank, n, store_dir)
    try:
        assert mod._engine_probe(eng, 3) == (-1, 0)  # every member's inbox is up
        mod._engine_allreduce(eng, np.zeros(1, np.float32), CODES["float32"], 0, 30.0)
        if rank == 2:
            mod._engine_send(eng, np.arange(4, dtype=np.int64), 0, 3, 30.0)
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1:
            store.wait(["done"], timedelta(seconds=60))
            return None
        got = np.zeros(4, np.int64)
        mod._engine_recv(eng, got, 2, 3, 30.0)  # queued before the death: still delivered
        assert got.tolist() == [0, 1, 2, 3]
        t0 = time.monotonic()
        with pytest.raises(plait.PeerLostError, match="no more messages from member 2"):
            mod._engine_recv(eng, np.zeros(2, np.int64), 2, 3, 60.0)
        took = time.monotonic() - t0
        store.set("done", b"1")
        return took
    finally:
        mod._engine_release(eng)


def test_recv_from_a_killed_member_is_peer_lost(ranks, tmp_path):
    got = ranks(_recv_from_killed, 3, timeout=120, args=(str(tmp_path),), may_die=(2,))
    assert got[1] is None and got[2] is None and got[0] < 10.0, got


def _until_done(mod, eng, reqs, limit=30.0):
    """Tests every request (in the order given, again and again) until all are done."""
    left, end = list(reqs), time.monotonic() + limit
    while left:
        left = [r for r in left if not mod._engine_p2p_test(eng, r)]
        assert time.monotonic() < end, f"{len(left)} requests still running"


def _p2p_exchange(rank, n, _addr, store_dir):
    """p2p_start: every member starts a receive from each other one, then sends to each (all in
    flight before any test), for sizes inline in the header, past it and of 1 MiB; then 20 messages
    on one (peer, tag) started back to back arrive in order; then a ring tested last-first."""
    mod, eng, store = _setup(rank, n, store_dir)
    try:
        for k in (0, 3, 241, 1 << 17):
            outs = {p: np.zeros(k, np.int64) for p in range(n) if p != rank}
            reqs = [mod._engine_p2p_start(eng, False, outs[p], p, 9, 30.0) for p in outs]
            srcs = {p: (np.arange(k) + 1000 * rank + 10 * p).astype(np.int64) for p in outs}
            reqs += [mod._engine_p2p_start(eng, True, srcs[p], p, 9, 30.0) for p in outs]
            _until_done(mod, eng, reqs)
            for p, got in outs.items():
                assert (got == np.arange(k) + 1000 * p + 10 * rank).all(), (k, p)
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        ins = [np.zeros(300, np.int32) for _ in range(20)]
        outs = [np.full(300, 100 * rank + i, np.int32) for i in range(20)]
        reqs = [mod._engine_p2p_start(eng, False, x, prv, 11, 30.0) for x in ins]
        reqs += [mod._engine_p2p_start(eng, True, x, nxt, 11, 30.0) for x in outs]
        _until_done(mod, eng, list(reversed(reqs)))
        assert [int(x[0]) for x in ins] == [100 * prv + i for i in range(20)]
        return True
    finally:
        mod._engine_release(eng)


@pytest.mark.parametrize("n", [2, 3])
def test_p2p_start_exchanges_in_flight_together(ranks, tmp_path, n):
    assert ranks(_p2p_exchange, n, timeout=120, args=(str(tmp_path),)) == [True] * n


def _p2p_errors(rank, n, _addr, store_dir, case):
    """mismatch: a started receive of another size is a MismatchError, and the fail() the
    multi-host communicator then makes ends the sender's send with that kind (the engine cannot
    tell the sender itself: its payload is already in gloo). timeout: a receive whose sender never
    sends times out at its deadline. fail: fail() ends a receive in flight with fail()'s kind, and
    release returns with another request still in flight."""
    mod, eng, store = _setup(rank, n, store_dir, label=case)
    try:
        if case == "mismatch":
            if rank == 1:
                with pytest.raises(plait.MismatchError, match="sizes differ"):
                    mod._engine_send(eng, np.zeros(600, np.int8), 0, 3, 30.0)
                return True
            r = mod._engine_p2p_start(eng, False, np.zeros(500, np.int8), 1, 3, 30.0)
            with pytest.raises(plait.MismatchError, match="member 1 sent 600 B"):
                _until_done(mod, eng, [r])
            mod._engine_fail(eng, 3, "sizes differ")
            return True
        if case == "timeout":
            if rank == 0:
                r = mod._engine_p2p_start(eng, False, np.zeros(8, np.int8), 1, 4, 0.3)
                t0 = time.monotonic()
                with pytest.raises(plait.TimeoutError, match="deadline passed"):
                    _until_done(mod, eng, [r])
                assert time.monotonic() - t0 < 3
                store.set("timed-out", b"1")
            else:
                store.wait(["timed-out"], timedelta(seconds=60))
            return True
        if rank == 0:
            r = mod._engine_p2p_start(eng, False, np.zeros(4096, np.int8), 1, 5, 30.0)
            keep = np.zeros(8, np.int8)
            mod._engine_p2p_start(eng, False, keep, 1, 6, 30.0)  # never tested: release ends it
            threading.Timer(0.3, mod._engine_fail, (eng, 3, "a mismatch elsewhere")).start()
            with pytest.raises(plait.MismatchError, match="mismatch elsewhere"):
                _until_done(mod, eng, [r])
            store.set("failed", b"1")
        else:
            store.wait(["failed"], timedelta(seconds=60))
        return True
    finally:
        mod._engine_release(eng)


@pytest.mark.parametrize("case", ["mismatch", "timeout", "fail"])
def test_p2p_start_errors_and_release_in_flight(ranks, tmp_path, case):
    assert ranks(_p2p_errors, 2, timeout=120, args=(str(tmp_path), case)) == [True, True]
