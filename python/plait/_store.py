"""Rendezvous key-value store over TCP: one StoreServer (rank 0 or plait-run), a Store client per rank.

Wire format, both directions: a u32 frame length, then one code byte (request op or reply status),
then fields, each a u32 length and its bytes. Numbers travel as ASCII decimals so that no width
limit leaks into the protocol; a wait time of "-1" means forever.
"""

import math
import operator
import os
import socket
import struct
import threading
import time

from . import _errors

_SET, _GET, _ADD, _WAIT, _DELETE = range(1, 6)
_OK, _TIMEOUT, _ERROR, _INVALID = range(4)
_U32 = struct.Struct("!I")
# A waiting server thread looks this often whether its client has hung up, so a client that dies
# mid-wait does not pin a thread forever.
_PEER_CHECK_S = 0.5
# Slack on top of a server-side wait before the client gives up on an answer that never comes.
_REPLY_SLACK_S = 30.0


def _frame(code, fields):
    parts = [bytes((code,))]
    for f in fields:
        parts += (_U32.pack(len(f)), f)
    body = b"".join(parts)
    return _U32.pack(len(body)) + body


def _recv_exact(sock, n):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError("connection closed by peer")
        got += k
    return buf


def _recv_frame(sock):
    (n,) = _U32.unpack(_recv_exact(sock, 4))
    body = bytes(_recv_exact(sock, n)) if n else b""
    if not body:
        raise ConnectionResetError("empty frame")
    fields, i = [], 1
    while i < len(body):
        (k,) = _U32.unpack_from(body, i)
        if i + 4 + k > len(body):
            raise ConnectionResetError("truncated frame")
        fields.append(body[i + 4 : i + 4 + k])
        i += 4 + k
    return body[0], fields


def _peer_gone(conn):
    # Called only while the client awaits our reply, so any readable byte would be a protocol
    # violation; an orderly EOF is the interesting case.
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class StoreServer:
    """Serves the store from daemon threads (one per connection) until close()."""

    def __init__(self, host="127.0.0.1", port=0):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(512)
        except OSError as e:
            self._sock.close()
            raise _errors.PlaitError(f"cannot listen on {host}:{port} for the plait store: {e}") from e
        self.host, self.port = host, self._sock.getsockname()[1]
        self._data = {}
        self._cond = threading.Condition()
        self._conns = set()
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, daemon=True, name=f"plait-store-{self.port}"
        )
        self._thread.start()

    @property
    def closed(self):
        return self._closed

    def keys(self, prefix=""):
        with self._cond:
            return sorted(k for k in self._data if k.startswith(prefix))

    def close(self):
        with self._cond:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            self._cond.notify_all()
        # shutdown() rather than close() alone: on Linux only shutdown wakes a thread blocked in
        # accept()/recv() on the same socket.
        for s in [self._sock, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._sock.close()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _accept_loop(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # e.g. EMFILE: back off instead of spinning
                continue
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            while True:
                code, fields = _recv_frame(conn)
                try:
                    reply = self._handle(code, fields, conn)
                except (IndexError, ValueError, UnicodeDecodeError) as e:
                    reply = _frame(_ERROR, [f"malformed request: {e}".encode()])
                if reply is None:
                    return
                conn.sendall(reply)
        except OSError:
            pass
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()

    def _handle(self, code, f, conn):
        if code == _SET:
            with self._cond:
                self._data[f[0].decode()] = f[1]
                self._cond.notify_all()
            return _frame(_OK, [])
        if code == _GET:
            key = f[0].decode()
            got = self._await([key], float(f[1]), conn)
            if got is None:
                return None
            missing, values = got
            return _frame(_TIMEOUT, [key.encode()]) if missing else _frame(_OK, values)
        if code == _ADD:
            key, delta = f[0].decode(), int(f[1])
            with self._cond:
                try:
                    new = int(self._data.get(key, b"0")) + delta
                except ValueError:
                    return _frame(_INVALID, [f"add: the value of key {key!r} is not an integer".encode()])
                self._data[key] = str(new).encode()
                self._cond.notify_all()
            return _frame(_OK, [str(new).encode()])
        if code == _WAIT:
            got = self._await([k.decode() for k in f[1:]], float(f[0]), conn)
            if got is None:
                return None
            return _frame(_TIMEOUT, [k.encode() for k in got[0]]) if got[0] else _frame(_OK, [])
        if code == _DELETE:
            with self._cond:
                existed = self._data.pop(f[0].decode(), None) is not None
            return _frame(_OK, [b"1" if existed else b"0"])
        return _frame(_ERROR, [f"unknown request code {code}".encode()])

    def _await(self, keys, timeout, conn):
        """(missing keys, values): values when none is missing; None when the client or the server
        went away meanwhile."""
        deadline = None if timeout < 0 else time.monotonic() + timeout
        with self._cond:
            while True:
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return [], [self._data[k] for k in keys]
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return missing, None
                if _peer_gone(conn):
                    return None
                self._cond.wait(_PEER_CHECK_S if left is None else min(left, _PEER_CHECK_S))


def _key(key):
    if not isinstance(key, str):
        raise _errors.InvalidArgument(f"store keys are str, not {type(key).__name__}")
    return key.encode()


class Store:
    """Blocking client. `timeout` bounds the connection attempts (the server may start later) and is
    the default for get()/wait(); None waits forever. One request at a time per client, so threads
    may share it, but a blocking get() holds it up for the others."""

    def __init__(self, host, port, timeout=60.0):
        self.host, self.port, self.timeout = host, int(port), _finite(timeout)
        self._lock = threading.Lock()
        self._gone = None
        self._sock = self._connect()

    @property
    def _addr(self):
        return f"{self.host}:{self.port}"

    def _connect(self):
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        delay = 0.01
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                sock = socket.create_connection(
                    (self.host, self.port), timeout=None if left is None else max(left, 0.01)
                )
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as e:
                if left is not None and left <= delay:
                    raise _errors.TimeoutError(
                        f"could not connect to the plait store at {self._addr} within {self.timeout:g} s: {e}"
                    ) from None
            time.sleep(delay)
            delay = min(2 * delay, 0.5)

    def _wait_s(self, timeout):
        return self.timeout if timeout is None else _finite(timeout)

    def _request(self, code, fields, wait_s=0.0):
        with self._lock:
            if self._sock is None:
                raise _errors.PlaitError(self._gone or f"the plait store client for {self._addr} is closed")
            try:
                self._sock.settimeout(
                    None
                    if wait_s is None or self.timeout is None
                    else wait_s + max(self.timeout, _REPLY_SLACK_S)
                )
                self._sock.sendall(_frame(code, fields))
                status, out = _recv_frame(self._sock)
            except OSError as e:
                what = "did not answer" if isinstance(e, socket.timeout) else f"is gone ({e})"
                self._gone = f"the plait store at {self._addr} {what}"
                self._sock.close()
                self._sock = None
                raise _errors.PlaitError(self._gone) from None
        if status == _ERROR:
            raise _errors.PlaitError(f"plait store at {self._addr}: {out[0].decode()}")
        if status == _INVALID:
            raise _errors.InvalidArgument(out[0].decode())
        return status, out

    def _timed_out(self, what, wait_s):
        raise _errors.TimeoutError(
            f"timed out after {wait_s:g} s waiting for {what} in the plait store at {self._addr}"
        )

    def set(self, key, value):
        if isinstance(value, str):
            value = value.encode()
        try:
            value = memoryview(value).tobytes()  # not bytes(): bytes(5) is five zeros
        except TypeError:
            raise _errors.InvalidArgument(f"store values are bytes, not {type(value).__name__}") from None
        self._request(_SET, [_key(key), value])

    def get(self, key, timeout=None):
        """The value of key, waiting (on the server) until some rank sets it."""
        wait_s = self._wait_s(timeout)
        status, out = self._request(_GET, [_key(key), _secs(wait_s)], wait_s)
        if status == _TIMEOUT:
            self._timed_out(f"key {key!r}", wait_s)
        return out[0]

    def add(self, key, delta):
        """Atomically adds delta to the integer stored at key (missing counts as 0); the new value."""
        try:
            delta = operator.index(delta)
        except TypeError:
            raise _errors.InvalidArgument(f"add: delta must be an int, not {type(delta).__name__}") from None
        return int(self._request(_ADD, [_key(key), str(delta).encode()])[1][0])

    def wait(self, keys, timeout=None):
        """Returns once every key exists."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        wait_s = self._wait_s(timeout)
        status, out = self._request(_WAIT, [_secs(wait_s), *map(_key, keys)], wait_s)
        if status == _TIMEOUT:
            missing = [k.decode() for k in out]
            self._timed_out(f"{len(missing)} of {len(keys)} keys: " + ", ".join(map(repr, missing)), wait_s)

    def delete(self, key):
        """Removes key; whether it existed."""
        return self._request(_DELETE, [_key(key)])[1][0] == b"1"

    def close(self):
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _finite(timeout):
    # inf would overflow socket.settimeout(); it means the same as None.
    return None if timeout is None or math.isinf(timeout) else float(timeout)


def _secs(wait_s):
    return b"-1" if wait_s is None else repr(max(float(wait_s), 0.0)).encode()


def store_from_env(rank=None):
    """(host, port, is_server) of the store the environment names.

    PLAIT_STORE=host:port (set by plait-run) names a store that is already served. Otherwise rank 0
    serves at MASTER_ADDR (default 127.0.0.1) and port MASTER_PORT+1: MASTER_PORT itself is left to
    torch's own store, which torchrun starts there. `rank` defaults to $RANK (else 0).
    """
    spec = os.environ.get("PLAIT_STORE")
    if spec:
        host, _, port = spec.rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit():
            raise _errors.InvalidArgument(f"PLAIT_STORE={spec!r} is not host:port")
        return host, int(port), False
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = os.environ.get("MASTER_PORT")
    if not port or not port.isdigit() or not 0 < int(port) < 65535:
        raise _errors.InvalidArgument(
            f"no usable plait store address (MASTER_PORT={port!r}): set PLAIT_STORE=host:port, or "
            "MASTER_ADDR and MASTER_PORT (plait's store then listens on MASTER_PORT+1)"
        )
    if rank is None:
        try:
            rank = int(os.environ.get("RANK", "0"))
        except ValueError:
            raise _errors.InvalidArgument(f"RANK={os.environ['RANK']!r} is not an integer") from None
    return host, int(port) + 1, rank == 0
