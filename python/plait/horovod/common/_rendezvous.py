"""The worker's side of elastic re-rendezvous (the launcher's side is plait/horovod/_launch.py).

The launcher (plait-run --min-np/--max-np) is the authority on who is in the world. For every
generation g it writes, in its store, `hvd/gen/<g>/<worker id>` = "rank,size" for each member and
then raises the counter `hvd/gen` to g. A worker joins the newest generation that names it (a
generation newer than the one it was in, after a failure), and meets the other members in a plait
rendezvous under the key prefix `hvd/<g>`. A worker the newest generation does not name (one the
launcher just started) marks itself waiting (`hvd/waiting/<id>`); the launcher then forms a
generation with it, and the running members see at their next commit() that a newer generation
exists (HostsUpdatedInterrupt)."""

import os
import time

_current = 0  # the generation this process is in (0: none yet)
_client = None


def enabled():
    return os.environ.get("PLAIT_ELASTIC") == "1"


def generation():
    return _current


def _store():
    global _client
    if _client is None:
        from plait import _store

        host, port, _ = _store.store_from_env()
        _client = _store.Store(host, port, timeout=60)
    return _client


def update_pending():
    """True when the launcher has formed a newer generation than this process's."""
    if not enabled() or _current == 0:
        return False
    return _store().add("hvd/gen", 0) > _current


def join(timeout):
    """(communicator, rank, size) of the newest generation that names this worker."""
    global _current
    from plait import _bootstrap, _errors

    client = _store()
    wid = os.environ["PLAIT_WORKER_ID"]
    end = time.monotonic() + timeout
    waiting = False
    while True:
        g = client.add("hvd/gen", 0)
        if g > _current:
            try:
                rank, size = (
                    int(v) for v in client.get(f"hvd/gen/{g}/{wid}", timeout=0.01).decode().split(",")
                )
            except Exception:  # noqa: BLE001 - this generation does not name us: wait for one that does
                rank = None
            if rank is not None:
                try:
                    comm = _bootstrap.init_in(
                        client,
                        f"hvd/{g}",
                        rank,
                        size,
                        timeout=float(os.environ.get("PLAIT_TIMEOUT", "300")),
                        init_timeout=min(30.0, max(1.0, end - time.monotonic())),
                        buffer_bytes=None,
                        keep=[],
                    )
                except _errors.PlaitError:
                    if client.add("hvd/gen", 0) > g and time.monotonic() < end:
                        continue  # someone left while we met: the launcher has a newer world
                    raise
                _current = g
                os.environ.update(
                    HOROVOD_RANK=str(rank),
                    HOROVOD_SIZE=str(size),
                    HOROVOD_LOCAL_RANK=str(rank),
                    HOROVOD_LOCAL_SIZE=str(size),
                    HOROVOD_CROSS_RANK="0",
                    HOROVOD_CROSS_SIZE="1",
                )
                return comm, rank, size
            if not waiting:
                client.add(f"hvd/waiting/{wid}", 1)
                waiting = True
        if time.monotonic() > end:
            raise TimeoutError(
                f"plait.horovod elastic worker {wid}: no world formed for it within {timeout:g} s "
                f"(newest generation {g}, this worker's {_current})"
            )
        time.sleep(0.02)
