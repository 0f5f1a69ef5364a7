"""The rendezvous store against stray and hostile clients: the job's token, frame caps, values it
parses, a wait that is not a number, duplicate ranks, and the launcher's wiring of all that."""

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import plait
from conftest import run_ranks
from plait import _errors, _store
from plait._store import Store, StoreServer


@pytest.fixture(autouse=True)
def _deadline(monkeypatch):
    monkeypatch.delenv(_store.TOKEN_ENV, raising=False)

    def expired(*_):
        raise RuntimeError("test exceeded its 60 s deadline")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _raw(server):
    s = socket.create_connection((server.host, server.port), timeout=5)
    return s


def _frame(code, fields):
    return _store._frame(code, fields)


def _reply(sock):
    return _store._recv_frame(sock)


def test_token_is_required_when_the_server_has_one():
    with StoreServer(token="s3cret") as server:
        with pytest.raises(_errors.PlaitError, match="token"):
            Store(server.host, server.port, timeout=2, token="wrong")
        with pytest.raises(_errors.PlaitError, match="token"):
            Store(server.host, server.port, timeout=2)
        with Store(server.host, server.port, timeout=2, token="s3cret") as good:
            good.set("k", b"v")
            assert good.get("k") == b"v"
        # a raw client that skips hello is refused and its request never lands
        s = _raw(server)
        s.sendall(_frame(_store._ADD, [b"plait/arrivals", b"1"]))
        status, out = _reply(s)
        assert status == _store._ERROR and b"hello" in out[0]
        assert s.recv(1) == b""  # hung up
        assert server.keys() == ["k"]


def test_token_from_the_environment(monkeypatch):
    monkeypatch.setenv(_store.TOKEN_ENV, "from-env")
    with StoreServer(token="from-env") as server, Store(server.host, server.port, timeout=2) as c:
        assert c.add("n", 2) == 2


def test_garbage_and_huge_frames_cost_nothing():
    with StoreServer(token="t") as server:
        s = _raw(server)
        s.sendall(b"\x00\x01garbage that is no frame at all")
        status, out = _reply(s)
        assert status == _store._ERROR
        # two clients announcing 1 GiB frames before hello: refused at once, nothing reserved
        for _ in range(2):
            s = _raw(server)
            s.sendall(struct.pack("!I", 1 << 30) + b"\x06")
            status, out = _reply(s)
            assert status == _store._ERROR
        with Store(server.host, server.port, timeout=2, token="t") as c:
            # after hello the cap is MAX_FRAME: a larger announcement is refused, not buffered
            c._sock.sendall(struct.pack("!I", _store.MAX_FRAME + 1) + b"\x01")
            status, out = _reply(c._sock)
            assert status == _store._ERROR and b"limit" in out[0]


def test_values_the_server_parses_are_validated():
    with StoreServer() as server, Store(server.host, server.port, timeout=2) as c:
        for code, fields, what in [
            (_store._GET, [b"k", b"nan"], b"wait time"),
            (_store._WAIT, [b"inf", b"k"], b"wait time"),
            (_store._WAIT, [b"-5", b"k"], b"wait time"),
            (_store._ADD, [b"k", b"1e9"], b"integer"),
            (_store._ADD, [b"k", b"9" * 400], b"integer"),
            (_store._GET, [b"\xff\xfe", b"0"], b"malformed"),
            (_store._SET, [b"only-a-key"], b"malformed"),
        ]:
            with pytest.raises(_errors.InvalidArgument, match=what.decode()):
                c._request(code, fields)
        assert server.keys() == []
        with pytest.raises(_errors.InvalidArgument, match="nan"):
            c.wait(["k"], timeout=float("nan"))
        with pytest.raises(_errors.InvalidArgument):
            c.get("k", timeout=-1)
        c.set("k", b"1")  # the connection survived every refusal
        assert c.get("k") == b"1"


def test_nan_wait_on_the_wire_does_not_spin():
    with StoreServer() as server, Store(server.host, server.port, timeout=2) as c:
        t = time.process_time()
        with pytest.raises(_errors.InvalidArgument):
            c._request(_store._WAIT, [b"nan", b"never"], 0.0)
        assert time.process_time() - t < 0.5


def test_bad_ports_are_refused_at_once():
    t = time.monotonic()
    for port in (99999, 0, -1, "http"):
        with pytest.raises(_errors.InvalidArgument):
            Store("127.0.0.1", port, timeout=30)
    assert time.monotonic() - t < 1.0


def _stray(rank, n, addr, ready):
    """Ranks 0..n-1 of a job; the extra process joins as rank 1 while the job runs."""
    import numpy as np

    if rank < n - 1:
        comm = plait.init(rank, n - 1, init_timeout=20, set_default=False)
        Store(*addr, timeout=5).add("job/up", 1)
        Store(*addr, timeout=5).wait(["stray/done"], timeout=20)
        out = comm.allreduce(np.full(4, rank + 1.0))
        comm.finalize()
        return out.tolist()
    Store(*addr, timeout=5).wait(["job/up"], timeout=20)
    t0 = time.monotonic()
    try:
        plait.init(1, n - 1, init_timeout=20, set_default=False)
        return "joined"
    except plait.InvalidArgument as e:
        return {"msg": str(e), "s": time.monotonic() - t0}
    finally:
        Store(*addr, timeout=5).set("stray/done", b"1")


@pytest.mark.parametrize("n", [2, 3])
def test_duplicate_rank_is_refused_and_the_job_goes_on(n):
    results = run_ranks(_stray, n + 1, timeout=60, args=(None,))
    stray = results[-1]
    assert isinstance(stray, dict), stray
    assert "rank 1 is already taken" in stray["msg"] and "pid" in stray["msg"], stray
    assert stray["s"] < 2.0, stray
    total = sum(range(1, n + 1))
    for r in range(n):
        assert results[r] == [float(total)] * 4


def test_forged_host_record_names_the_rank():
    def body(rank, n, addr):
        if rank == 1:  # not plait: writes a host record by hand
            c = Store(*addr, timeout=5)
            c.add("plait/arrivals/1", 1)
            c.add("plait/arrivals", 1)  # a stray count of the old scheme changes nothing
            c.set("plait/0/host/1", b"no newline here")
            return None
        try:
            plait.init(0, 2, init_timeout=10, set_default=False)
        except plait.InvalidArgument as e:
            return str(e)
        return "joined"

    msg = run_ranks(body, 2, timeout=30)[0]
    assert "rank 1's record" in msg, msg


def test_launcher_hands_its_ranks_a_token_and_binds_loopback(tmp_path):
    prog = tmp_path / "probe.py"
    prog.write_text(
        textwrap.dedent(
            """
            import os, socket
            from plait import _store
            host, port = os.environ["PLAIT_STORE"].rsplit(":", 1)
            tok = os.environ.get("PLAIT_STORE_TOKEN", "")
            ok = _store.Store(host, int(port), timeout=5)  # presents the token from the env
            ok.set("r" + os.environ["RANK"], b"1")
            try:
                _store.Store(host, int(port), timeout=5, token="guess")
                stray = "admitted"
            except Exception as e:
                stray = "refused"
            print("RESULT", host, len(tok), stray, flush=True)
            """
        )
    )
    env = dict(os.environ)
    env.pop(_store.TOKEN_ENV, None)
    out = subprocess.run(
        [sys.executable, "-m", "plait.run", "--nproc", "2", str(prog)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    # Each line arrives prefixed with its rank ("[0] RESULT ...").
    lines = [ln.split()[1:] for ln in out.stdout.splitlines() if ln.split()[1:2] == ["RESULT"]]
    assert sorted(ln.split()[0] for ln in out.stdout.splitlines() if "RESULT" in ln) == ["[0]", "[1]"], (
        out.stdout
    )
    assert len(lines) == 2, out.stdout + out.stderr
    for _, host, toklen, stray in lines:
        assert host == "127.0.0.1"
        assert int(toklen) >= 32
        assert stray == "refused"


def test_many_threads_waiting_stay_cheap():
    with StoreServer() as server:
        clients = [Store(server.host, server.port, timeout=5) for _ in range(8)]
        ts = [threading.Thread(target=c.wait, args=(["go"], 5.0)) for c in clients]
        for t in ts:
            t.start()
        with Store(server.host, server.port, timeout=5) as c:
            c.set("go", b"")
        for t in ts:
            t.join(5)
        assert not any(t.is_alive() for t in ts)
        for c in clients:
            c.close()
