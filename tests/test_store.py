import builtins
import signal
import socket
import threading
import time

import pytest

from plait import _errors
from plait._store import Store, StoreServer, store_from_env


@pytest.fixture(autouse=True)
def _deadline():
    # A hang in the store must fail the test, not the whole run; no pytest-timeout dependency.
    def expired(*_):
        raise RuntimeError("test exceeded its 30 s deadline")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def server():
    with StoreServer() as s:
        yield s


@pytest.fixture
def client(server):
    with Store(server.host, server.port, timeout=10) as c:
        yield c


def test_set_get_delete_keys(server, client):
    client.set("a", b"1")
    client.set("b", b"")
    client.set("big", bytes(range(256)) * 4096)
    client.set("ключ", bytearray(b"x"))
    assert client.get("a") == b"1"
    assert client.get("b") == b""
    assert client.get("big") == bytes(range(256)) * 4096
    assert client.get("ключ") == b"x"
    assert server.keys() == ["a", "b", "big", "ключ"]
    assert server.keys("b") == ["b", "big"]
    assert client.delete("a") is True
    assert client.delete("a") is False
    with pytest.raises(_errors.TimeoutError):
        client.get("a", timeout=0.1)


def test_add(client):
    assert client.add("n", 5) == 5
    assert client.add("n", -7) == -2
    assert client.get("n") == b"-2"
    client.set("s", b"not a number")
    with pytest.raises(_errors.InvalidArgument, match="'s'"):
        client.add("s", 1)


def test_bad_arguments(client):
    with pytest.raises(_errors.InvalidArgument):
        client.set(1, b"x")
    with pytest.raises(_errors.InvalidArgument):
        client.set("k", 5)
    with pytest.raises(_errors.InvalidArgument):
        client.add("k", 1.5)


def test_wait(client):
    client.set("x", b"")
    client.wait(["x"])
    client.wait([])
    start = time.monotonic()
    with pytest.raises(_errors.TimeoutError) as info:
        client.wait(["x", "y", "z"], timeout=0.3)
    assert 0.25 < time.monotonic() - start < 5
    assert isinstance(info.value, builtins.TimeoutError)
    assert "'y'" in str(info.value) and "'z'" in str(info.value) and "'x'" not in str(info.value)


def test_get_timeout_names_key(server, client):
    with pytest.raises(_errors.TimeoutError, match=f"'missing'.*{server.port}"):
        client.get("missing", timeout=0.2)
    with Store(server.host, server.port, timeout=0.2) as short:  # the client's default applies
        with pytest.raises(_errors.TimeoutError):
            short.get("missing")


def test_get_blocks_until_set(server, client):
    def later():
        time.sleep(0.3)
        with Store(server.host, server.port) as other:
            other.set("k", b"v")

    t = threading.Thread(target=later)
    start = time.monotonic()
    t.start()
    assert client.get("k", timeout=10) == b"v"
    assert time.monotonic() - start >= 0.25
    t.join()


def test_concurrent_adds():
    with StoreServer() as server:
        results = []

        def worker():
            with Store(server.host, server.port) as c:
                results.extend(c.add("count", 1) for _ in range(100))

        threads = [threading.Thread(target=worker) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == list(range(1, 1601))


def test_shared_client_is_thread_safe(client):
    results = []
    threads = [
        threading.Thread(target=lambda: results.extend(client.add("c", 2) for _ in range(50)))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(2, 801, 2))


def test_64_waiting_clients(server):
    clients = [Store(server.host, server.port) for _ in range(64)]
    got = []
    threads = [threading.Thread(target=lambda c=c: got.append(c.get("go", timeout=20))) for c in clients]
    for t in threads:
        t.start()
    time.sleep(0.2)
    with Store(server.host, server.port) as other:  # the server is not stuck behind 64 waiters
        assert other.add("unrelated", 1) == 1
        other.set("go", b"1")
    for t in threads:
        t.join()
    assert got == [b"1"] * 64
    for c in clients:
        c.close()


def test_client_waits_for_late_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    servers = []
    t = threading.Timer(0.3, lambda: servers.append(StoreServer("127.0.0.1", port)))
    t.start()
    try:
        with Store("127.0.0.1", port, timeout=10) as c:
            c.set("k", b"v")
            assert c.get("k") == b"v"
    finally:
        t.join()
        for s in servers:
            s.close()


def test_connect_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(_errors.TimeoutError, match=str(port)):
        Store("127.0.0.1", port, timeout=0.3)


def test_server_gone():
    server = StoreServer()
    c = Store(server.host, server.port)
    c.set("k", b"v")
    server.close()
    for _ in range(2):  # and it stays gone
        with pytest.raises(_errors.PlaitError, match=f"127.0.0.1:{server.port} is gone"):
            c.get("k")
    c.close()


def _in_thread(fn, *args):
    """Runs fn in a thread; returns the thread and a list that receives fn's exception."""
    caught = []

    def run():
        try:
            fn(*args)
        except Exception as e:
            caught.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, caught


def test_server_close_releases_waiters():
    server = StoreServer()
    c = Store(server.host, server.port)
    t, caught = _in_thread(c.get, "never")
    time.sleep(0.2)
    server.close()
    t.join(5)
    assert not t.is_alive() and isinstance(caught[0], _errors.PlaitError)
    c.close()


def test_disconnected_waiter_frees_its_server_thread(server):
    # A client waiting forever that dies must not pin a server thread forever.
    c = Store(server.host, server.port, timeout=None)
    t, caught = _in_thread(c.get, "never")
    time.sleep(0.2)
    c._sock.shutdown(socket.SHUT_RDWR)
    t.join(5)
    assert isinstance(caught[0], _errors.PlaitError)
    deadline = time.monotonic() + 5
    while server._conns and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server._conns


def test_store_from_env(monkeypatch):
    for var in ("PLAIT_STORE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(_errors.InvalidArgument, match="PLAIT_STORE"):
        store_from_env()
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert store_from_env() == ("127.0.0.1", 29501, True)
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("RANK", "3")
    assert store_from_env() == ("node0", 29501, False)
    assert store_from_env(rank=0) == ("node0", 29501, True)
    monkeypatch.setenv("PLAIT_STORE", "10.0.0.1:1234")
    assert store_from_env() == ("10.0.0.1", 1234, False)
    monkeypatch.setenv("PLAIT_STORE", "[::1]:1234")
    assert store_from_env() == ("::1", 1234, False)
    monkeypatch.setenv("PLAIT_STORE", "nonsense")
    with pytest.raises(_errors.InvalidArgument):
        store_from_env()
