"""Shared test harness: run a function on n forked ranks around one store, with a hard deadline.

`run_ranks(fn, n)` forks n processes; rank r runs fn(r, n, store_addr, *args) and sends back its
return value or its exception. The parent never trusts a child to finish: on the deadline it
SIGKILLs every rank still running and fails naming them. Every run, passing or failing, ends with
the children reaped, plait._shm.sweep_stale() and a check that no shared-memory segment made by
this run is left behind.
"""

import glob
import multiprocessing as mp
import os
import re
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait as wait_any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Ranks are forked from this process. GNU OpenMP is not fork-safe: once a test has run a parallel
# torch op here, a forked rank's first parallel op waits forever on the parent's thread team
# (seen: 4-rank torch tests hung in gomp_team_barrier_wait_end after a Horovod test computed its
# reference training here). One thread per process, as torchrun and plait-run set for their ranks,
# means no team is ever made. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

SHM_GLOB = "/dev/shm/plait-*"


def _segment_names():
    from plait import _shm

    return {os.path.basename(os.fsdecode(seg)) for seg in _shm.list_segments()}


def _creator(name):
    """The pid in a segment name plait-<pid>-<hex>, or None."""
    m = re.match(r"plait-(\d+)-", name)
    return int(m.group(1)) if m else None


_SESSION_PIDS = {os.getpid()}  # this process and every rank it forked


def _child(fn, rank, n, addr, args, env, conn):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(n), "PLAIT_STORE": "%s:%d" % addr})
    for key, value in (env or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)
    try:
        msg = ("ok", fn(rank, n, addr, *args))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        msg = ("err", type(e).__name__, str(e), "".join(traceback.format_exception(e)))
    try:
        conn.send(msg)
    except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
        conn.send(
            (
                "err",
                type(e).__name__,
                "could not send the result: %s" % e,
                "".join(traceback.format_exception(e)),
            )
        )
    conn.close()
    # A default communicator the function left open is closed as a normal exit would close it.
    plait = sys.modules.get("plait")
    if plait is not None:
        try:
            plait.finalize()
        except Exception:  # noqa: BLE001 - none open, or already aborted
            pass


def _describe_exit(code):
    if code is None:
        return "still running"
    if code < 0:
        try:
            return "killed by %s" % signal.Signals(-code).name
        except ValueError:
            return "killed by signal %d" % -code
    return "exited with code %d" % code


def run_ranks(fn, n, timeout=60, args=(), env=None, *, may_die=(), start_method="fork"):
    """Runs fn(rank, n, (host, port), *args) on n forked ranks; returns their return values.

    Fails the test naming each rank that raised (with its traceback), died, or had not finished
    after `timeout` seconds (those are SIGKILLed). Ranks in `may_die` are allowed to end without
    answering (a test that kills them); their result is None.
    """
    from plait import _shm
    from plait._store import StoreServer

    before = _segment_names()
    # start_method="spawn" for ranks that use CUDA: a forked child cannot use CUDA once the parent has
    # initialised it (and plait.build_info() does).
    ctx = mp.get_context(start_method)
    procs, pending, answers, problems = [], {}, {}, []
    server = StoreServer()
    start = time.monotonic()
    deadline = start + timeout
    try:
        addr = (server.host, server.port)
        for rank in range(n):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(fn, rank, n, addr, tuple(args), env, writer),
                name="plait-rank%d" % rank,
                daemon=True,
            )
            proc.start()
            writer.close()
            procs.append(proc)
            pending[reader] = rank
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for reader in wait_any(list(pending), timeout=left):
                rank = pending.pop(reader)
                try:
                    answers[rank] = reader.recv()
                except (EOFError, OSError):
                    answers[rank] = None
                reader.close()
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.join()
        for reader in pending:
            reader.close()
        server.close()

    unfinished = sorted(pending.values())
    if unfinished:
        problems.append(
            "timed out after %.0f s: rank(s) %s had not finished (SIGKILLed)" % (timeout, unfinished)
        )
    exited_late = sorted(set(stuck) - set(unfinished))
    if exited_late:
        problems.append("rank(s) %s answered but did not exit before the deadline (SIGKILLed)" % exited_late)
    results = [None] * n
    for rank in range(n):
        if rank not in answers:
            continue
        msg = answers[rank]
        if msg is None:
            if rank not in may_die:
                problems.append(
                    "rank %d died without answering: %s" % (rank, _describe_exit(procs[rank].exitcode))
                )
        elif msg[0] == "ok":
            results[rank] = msg[1]
        else:
            _, name, text, tb = msg
            first = text.splitlines()[0] if text else ""
            problems.append("rank %d raised %s: %s\n%s" % (rank, name, first, tb))

    # A run in which no rank died must leave nothing behind; after a death the survivors or
    # sweep_stale() clean up, and after the sweep nothing of this run may be left either way.
    pids = {p.pid for p in procs}
    _SESSION_PIDS.update(pids)
    left = sorted(s for s in _segment_names() - before if _creator(s) in pids)
    if left and not may_die:
        problems.append("segments left in /dev/shm by a run in which no rank died: %s" % left)
    _shm.sweep_stale()
    left = sorted(s for s in _segment_names() - before if _creator(s) in pids)
    if left:
        problems.append("segments still in /dev/shm after sweep_stale(): %s" % left)
    if problems:
        pytest.fail(
            "run_ranks(%s, n=%d) after %.1f s:\n%s"
            % (getattr(fn, "__name__", fn), n, time.monotonic() - start, "\n\n".join(problems)),
            pytrace=False,
        )
    return results


@pytest.fixture
def ranks():
    """The run_ranks helper as a fixture."""
    return run_ranks


@pytest.fixture(scope="session", autouse=True)
def _no_shm_left_at_end():
    """At the end of the session /dev/shm holds no plait- segment made by this session (this
    process or a rank it forked). Other users' live segments are none of our business."""
    yield
    left = sorted(s for s in glob.glob(SHM_GLOB) if _creator(os.path.basename(s)) in _SESSION_PIDS)
    assert not left, "plait segments left in /dev/shm at the end of the session: %s" % left
