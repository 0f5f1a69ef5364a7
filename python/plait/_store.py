"""Rendezvous key-value store over TCP: one StoreServer (rank 0 or plait-run), a Store client per rank.

Wire format, both directions: a u32 frame length, then one code byte (request op or reply status),
then fields, each a u32 length and its bytes. Numbers travel as ASCII decimals so that no width
limit leaks into the protocol; a wait time of "-1" means forever.

A client's first frame is HELLO with the job's token. A server given a token (plait-run makes a
random one per job and hands it to its ranks as PLAIT_STORE_TOKEN) answers anything else, or a
wrong token, with an error and hangs up: a stray process cannot join, or disturb, the job's
rendezvous. Frames are capped (small until the client has said hello) and read as they arrive, so
announcing a huge frame reserves nothing.
"""

import hmac
import math
import operator
import os
import socket
import struct
import threading
import time

from . import _errors

_SET, _GET, _ADD, _WAIT, _DELETE, _HELLO = range(1, 7)
_OK, _TIMEOUT, _ERROR, _INVALID = range(4)
_U32 = struct.Struct("!I")
TOKEN_ENV = "PLAIT_STORE_TOKEN"
# Largest frame either side accepts: plait's values are small (host tables, segment names), and a
# cap keeps a bad or hostile length from costing memory. Before hello, only a hello fits.
MAX_FRAME = 64 << 20
_HELLO_FRAME = 4096
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
    # Grown as bytes arrive (at most 1 MiB per read), not reserved from the announced length.
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(n - len(buf), 1 << 20))
        if not part:
            raise ConnectionResetError("connection closed by peer")
        buf += part
    return buf


class _FrameTooBig(ConnectionResetError):
    pass


def _recv_frame(sock, cap=MAX_FRAME):
    (n,) = _U32.unpack(_recv_exact(sock, 4))
    if n > cap:
        raise _FrameTooBig(f"a frame of {n} bytes (the limit is {cap})")
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

    def __init__(self, host="127.0.0.1", port=0, token=None):
        self._token = token.encode() if isinstance(token, str) else token
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
            if not self._hello(conn):
                return
            while True:
                try:
                    code, fields = _recv_frame(conn)
                except _FrameTooBig as e:
                    conn.sendall(_frame(_ERROR, [f"refused {e}".encode()]))
                    return
                try:
                    reply = self._handle(code, fields, conn)
                except (IndexError, ValueError, UnicodeDecodeError, OverflowError) as e:
                    reply = _frame(_INVALID, [f"plait store: malformed request: {e}".encode()])
                if reply is None:
                    return
                conn.sendall(reply)
        except OSError:
            pass
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()

    def _hello(self, conn):
        """The client's first frame: HELLO and, where this store has one, the job's token."""
        try:
            code, fields = _recv_frame(conn, _HELLO_FRAME)
        except _FrameTooBig:
            code, fields = None, []
        if code == _HELLO and (
            self._token is None or (fields and hmac.compare_digest(fields[0], self._token))
        ):
            conn.sendall(_frame(_OK, []))
            return True
        why = (
            "refused: the first request must present the job's token"
            if self._token is not None and code == _HELLO
            else "refused: not a plait store client (or an older one) saying hello"
        )
        conn.sendall(_frame(_ERROR, [f"{why} (${TOKEN_ENV}, set by plait-run)".encode()]))
        return False

    def _handle(self, code, f, conn):
        if code == _SET:
            with self._cond:
                self._data[f[0].decode()] = f[1]
                self._cond.notify_all()
            return _frame(_OK, [])
        if code == _GET:
            key = f[0].decode()
            got = self._await([key], _parse_wait(f[1]), conn)
            if got is None:
                return None
            missing, values = got
            return _frame(_TIMEOUT, [key.encode()]) if missing else _frame(_OK, values)
        if code == _ADD:
            key, delta = f[0].decode(), _parse_int(f[1])
            with self._cond:
                try:
                    new = int(self._data.get(key, b"0")) + delta
                except ValueError:
                    return _frame(_INVALID, [f"add: the value of key {key!r} is not an integer".encode()])
                self._data[key] = str(new).encode()
                self._cond.notify_all()
            return _frame(_OK, [str(new).encode()])
        if code == _WAIT:
            got = self._await([k.decode() for k in f[1:]], _parse_wait(f[0]), conn)
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


def _parse_wait(field):
    """A wait time off the wire: seconds >= 0, or -1 for forever; nan, inf and the rest refused."""
    t = float(field.decode("ascii"))
    if not (t >= 0 or t == -1) or math.isinf(t):
        raise ValueError(f"wait time {field!r} is not a number of seconds >= 0 (or -1)")
    return t


def _parse_int(field):
    text = field.decode("ascii")
    if not text.lstrip("-").isdigit() or len(text) > 40:
        raise ValueError(f"{field[:50]!r} is not an integer")
    return int(text)


def _key(key):
    if not isinstance(key, str):
        raise _errors.InvalidArgument(f"store keys are str, not {type(key).__name__}")
    return key.encode()


class Store:
    """Blocking client. `timeout` bounds the connection attempts (the server may start later) and is
    the default for get()/wait(); None waits forever. One request at a time per client, so threads
    may share it, but a blocking get() holds it up for the others."""

    def __init__(self, host, port, timeout=60.0, token=None):
        self.host, self.port, self.timeout = host, _port(port, f"{host}:{port}"), _finite(timeout)
        token = os.environ.get(TOKEN_ENV) if token is None else token
        self._token = token.encode() if isinstance(token, str) else (token or b"")
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
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as e:
                if left is not None and left <= delay:
                    raise _errors.TimeoutError(
                        f"could not connect to the plait store at {self._addr} within {self.timeout:g} s: {e}"
                    ) from None
            else:
                return self._say_hello(sock)
            time.sleep(delay)
            delay = min(2 * delay, 0.5)

    def _say_hello(self, sock):
        try:
            sock.settimeout(max(self.timeout or 0.0, _REPLY_SLACK_S))
            sock.sendall(_frame(_HELLO, [self._token]))
            status, out = _recv_frame(sock)
            sock.settimeout(None)
        except OSError as e:
            sock.close()
            raise _errors.PlaitError(f"the plait store at {self._addr} did not answer hello: {e}") from None
        if status != _OK:
            sock.close()
            why = out[0].decode(errors="replace") if out else "no reason given"
            raise _errors.PlaitError(f"the plait store at {self._addr} {why}")
        return sock

    def _wait_s(self, timeout):
        if timeout is None:
            return self.timeout
        timeout = _errors.number(timeout, "store wait: timeout")
        if not timeout >= 0:
            raise _errors.InvalidArgument(f"store wait: timeout must be >= 0 seconds, got {timeout!r}")
        return _finite(timeout)

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
        if len(value) > MAX_FRAME - 1024:
            raise _errors.InvalidArgument(
                f"store value for {key!r} is {len(value)} bytes; "
                f"the plait store takes up to {MAX_FRAME - 1024}"
            )
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

    def check(self, keys):
        """Whether every key exists now (no waiting)."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        return self._request(_WAIT, [b"0", *map(_key, keys)], 0.0)[0] == _OK

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
    if timeout is None or math.isinf(timeout):
        return None
    if not float(timeout) >= 0:
        raise _errors.InvalidArgument(f"store timeout must be >= 0 seconds, got {timeout!r}")
    return float(timeout)


def _port(port, where):
    try:
        p = operator.index(port) if not isinstance(port, str) else int(port)
    except (TypeError, ValueError):
        raise _errors.InvalidArgument(f"plait store {where}: port {port!r} is not an integer") from None
    if not 0 < p < 65536:
        raise _errors.InvalidArgument(f"plait store {where}: port {p} is not in 1..65535")
    return p


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
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _errors.InvalidArgument(f"PLAIT_STORE={spec!r} is not host:port (a port in 1..65535)")
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
