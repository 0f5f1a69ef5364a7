"""plait's rendezvous over torch's store (the PrefixStore c10d hands a backend creator).

plait.init() takes a plait._store.Store; this is one that forwards to a torch Store instead of
speaking plait's TCP protocol, so every process group rendezvouses through the store torch
already set up (env://, tcp://, file://, torchrun's TCPStore) and needs no port of its own.
"""

from datetime import timedelta

from plait import _errors, _store


class TorchStore(_store.Store):
    """The subset of plait._store.Store that plait.init uses, on top of a torch.distributed.Store.

    Subclassing (rather than duck typing) only because plait.init accepts instances of Store;
    Store.__init__, which would connect a socket, is deliberately not called.
    """

    def __init__(self, store, timeout=None):  # noqa: D107 - see the class docstring
        self._torch = store
        self.timeout = None if timeout is None else float(timeout)
        self.host, self.port = "torch-store", 0

    def set(self, key, value):
        if isinstance(value, str):
            value = value.encode()
        self._torch.set(key, bytes(value))

    def get(self, key, timeout=None):
        wait_s = self.timeout if timeout is None else float(timeout)
        if wait_s:  # 0: the key is known to be there (torch reads a zero wait as its default)
            self.wait([key], wait_s)
        try:
            return bytes(self._torch.get(key))
        except RuntimeError as e:  # DistStoreError, or a bare RuntimeError from some stores
            raise _errors.TimeoutError(f"waiting for key {key!r} in torch's store: {e}") from None

    def add(self, key, delta):
        return int(self._torch.add(key, int(delta)))

    def wait(self, keys, timeout=None):
        keys = [keys] if isinstance(keys, str) else list(keys)
        wait_s = self.timeout if timeout is None else float(timeout)
        if wait_s is not None and wait_s <= 0:  # torch reads a zero timeout as its default
            if not self.check(keys):
                raise _errors.TimeoutError(f"keys {keys} are not in torch's store yet")
            return
        try:
            if wait_s is None:
                self._torch.wait(keys)
            else:
                self._torch.wait(keys, timedelta(seconds=wait_s))
        except RuntimeError as e:  # DistStoreError, or FileStore's bare "Wait timeout"
            raise _errors.TimeoutError(
                f"timed out after {wait_s:g} s waiting for {keys} in torch's store: {e}"
            ) from None

    def check(self, keys):
        """Whether every key exists now (plait's rendezvous looks for failures between waits)."""
        return bool(self._torch.check([keys] if isinstance(keys, str) else list(keys)))

    def delete(self, key):
        return bool(self._torch.delete_key(key))

    def close(self):
        self._torch = None  # torch owns the store; only our reference goes
