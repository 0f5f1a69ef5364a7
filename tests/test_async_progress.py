"""When an async collective starts (core/wakeup.h).

plait leaves a small async collective (up to 64 KiB) to its caller, who runs it on its own thread
when it waits, for up to PLAIT_ASYNC_GRACE_US; after that the progress thread starts it.
Everything that means "the caller will not run it itself soon" starts it at once: a bounded wait,
done(), a later blocking call or send/recv queued behind it, a wait on a later call, finalize, and
on the torch backend a Future handed out (DDP's reducer) or Work.is_completed().

The tests set a grace of 10 s, so a path that forgot to start the call shows as a wait of 5 s or
more (half the grace: the progress thread's first look), far beyond what the calls take even on a
loaded 2-core machine; and one test checks the progress thread does start a call nobody waits on.
"""

import time

import numpy as np
import plait
import pytest
from conftest import run_ranks

LONG = {"PLAIT_ASYNC_GRACE_US": "10000000"}  # 10 s: only a forgotten start waits that long
STALL_S = 4.0  # below half the grace


def _time_each(barrier, cases):
    """Seconds each (name, fn) took, every one started together on all ranks."""
    took = {}
    for name, fn in cases:
        barrier()
        t0 = time.monotonic()
        fn()
        took[name] = time.monotonic() - t0
    return took


def _none_stalled(results):
    for rank, took in enumerate(results):
        slow = {k: round(v, 2) for k, v in took.items() if v > STALL_S}
        assert not slow, f"rank {rank}: these paths left the call to the progress thread's timer: {slow}"


def _expect(n, k=0):
    """allreduce of np.arange(5) + rank + k over n ranks."""
    return n * (np.arange(5) + k) + n * (n - 1) // 2


def _every_start(rank, n, store):
    with plait.init(rank, n, store=store, timeout=30) as comm:

        def arr(k):
            return (np.arange(5) + rank + k).astype(np.float64)

        def wait():
            x = arr(1)
            comm.allreduce(x, out=x, async_op=True).wait()
            assert np.array_equal(x, _expect(n, 1)), x

        def bounded_wait():
            x = arr(2)
            comm.allreduce(x, out=x, async_op=True).wait(timeout=30)
            assert np.array_equal(x, _expect(n, 2)), x

        def poll():
            x = arr(3)
            h = comm.allreduce(x, out=x, async_op=True)
            while not h.done():
                pass
            assert np.array_equal(h.wait(), _expect(n, 3))

        def blocking_call_behind():
            x, y = arr(4), arr(5)
            h = comm.allreduce(x, out=x, async_op=True)
            comm.allreduce(y, out=y)  # queued behind x's call, which must run first
            assert h.done() and np.array_equal(x, _expect(n, 4)) and np.array_equal(y, _expect(n, 5))

        def wait_on_a_later_call():
            x = arr(6)
            h1 = comm.allreduce(x, out=x, async_op=True)
            h2 = comm.allgather(np.full(3, rank, np.int32), async_op=True)
            g = h2.wait()  # h1 is ahead of it: this thread cannot run h2 first
            assert np.array_equal(g, np.repeat(np.arange(n), 3).reshape(n, 3).astype(np.int32))
            assert np.array_equal(h1.wait(), _expect(n, 6))

        def send_recv_behind():
            if n == 1:
                return
            x = arr(7)
            h = comm.allreduce(x, out=x, async_op=True)
            got = np.empty(4, np.int64)
            hs = comm.send(np.full(4, rank, np.int64), (rank + 1) % n, tag=3, async_op=True)
            comm.recv(got, (rank - 1) % n, tag=3, async_op=True).wait()
            hs.wait()
            assert np.array_equal(got, np.full(4, (rank - 1) % n)), got
            assert np.array_equal(h.wait(), _expect(n, 7))

        def many_then_reverse():
            xs = [arr(10 + k) for k in range(6)]
            hs = [comm.allreduce(x, out=x, async_op=True) for x in xs]
            for k in reversed(range(6)):
                assert np.array_equal(hs[k].wait(), _expect(n, 10 + k))

        took = _time_each(
            comm.barrier,
            [
                ("wait", wait),
                ("bounded wait", bounded_wait),
                ("done() polling", poll),
                ("blocking call behind it", blocking_call_behind),
                ("wait on a later call", wait_on_a_later_call),
                ("send/recv behind it", send_recv_behind),
                ("waits in reverse order", many_then_reverse),
            ],
        )
        x = arr(20)
        h = comm.allreduce(x, out=x, async_op=True)
        t0 = time.monotonic()
    took["finalize"] = time.monotonic() - t0  # the with block's end ran the queued call
    assert h._task.done() and np.array_equal(h.wait(), _expect(n, 20))
    return took


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_start_of_a_deferred_call(n):
    _none_stalled(run_ranks(_every_start, n, timeout=90, env=LONG))


def _nobody_waits(rank, n, store, count):
    """Rank 0 issues an async allreduce and then blocks outside plait: its progress thread must
    run the call for rank 1's blocking one to finish."""
    from plait._store import Store

    kv = Store(*store)
    with plait.init(rank, n, store=store, timeout=60) as comm:
        x = np.full(count, rank + 1.0)
        comm.barrier()
        if rank == 0:
            h = comm.allreduce(x, out=x, async_op=True)
            kv.wait(["peer-done"], timeout=30)  # raises if the call never ran
            # Rank 1's part is over, so rank 0's progress thread ran it; it may still be finishing.
            # (_task.done(), unlike Handle.done(), does not start the call.)
            end = time.monotonic() + 10
            while not h._task.done() and time.monotonic() < end:
                time.sleep(0.001)
            assert h._task.done()
            assert np.array_equal(h.wait(), np.full(count, 3.0))
            return None
        t0 = time.monotonic()
        comm.allreduce(x, out=x)
        took = time.monotonic() - t0
        kv.set("peer-done", b"1")
        assert np.array_equal(x, np.full(count, 3.0))
        return took


@pytest.mark.parametrize("grace_s", [0, 0.001, 1.0])
def test_progress_thread_runs_a_call_nobody_waits_on(grace_s):
    env = {"PLAIT_ASYNC_GRACE_US": str(int(grace_s * 1e6))}
    took = run_ranks(_nobody_waits, 2, timeout=60, args=(3,), env=env)[1]
    if grace_s >= 1.0:
        # Left to rank 0's waiter first: its progress thread looks after half the grace. A lower
        # bound only, which load can only make later.
        assert took >= 0.6 * grace_s / 2, f"rank 0's call started after {took:.3f} s, before the grace"


@pytest.mark.parametrize(
    "count, limit",
    [(64 * 1024 // 8 + 1, None), (1, "0"), (64 * 1024 // 8 + 1, "1048576")],
    ids=["64KiB+8B", "8B-limit0", "64KiB+8B-limit1MiB"],
)
def test_only_small_async_calls_wait_for_their_caller(count, limit):
    """Over PLAIT_ASYNC_DEFER_BYTES (64 KiB) a call is not left to its waiter: the wake-up is small
    beside the call, and starting at once overlaps it with the caller's work."""
    deferred = count * 8 <= int(limit or 65536)
    # deferred: a 1 s grace, and a lower bound on the wait; not: a 10 s one, and an upper bound
    grace = "1000000" if deferred else LONG["PLAIT_ASYNC_GRACE_US"]
    env = {"PLAIT_ASYNC_GRACE_US": grace, "PLAIT_ASYNC_DEFER_BYTES": limit}
    took = run_ranks(_nobody_waits, 2, timeout=60, args=(count,), env=env)[1]
    if deferred:
        assert took >= 0.3, f"a {count * 8} B call under a limit of {limit} started after {took:.3f} s"
    else:
        assert took < STALL_S, (
            f"a {count * 8} B call over the limit ({limit}) waited {took:.2f} s for the timer"
        )


def _bad_grace(rank, n, store, var):
    with pytest.raises(plait.InvalidArgument, match=var):
        plait.init(rank, n, store=store, timeout=10)
    return True


@pytest.mark.parametrize(
    "var, value",
    [("PLAIT_ASYNC_GRACE_US", v) for v in ("soon", "-5", "nan", "1e9")]
    + [("PLAIT_ASYNC_DEFER_BYTES", v) for v in ("lots", "-1")],
)
def test_bad_async_policy_is_refused(var, value):
    assert run_ranks(_bad_grace, 1, timeout=30, args=(var,), env={var: value}) == [True]


# ---------------------------------------------------------------- the torch backend


def _torch_starts(rank, n, store_dir):
    import torch
    import torch.distributed as dist
    from test_torch_backend import init_pg

    init_pg("plait", rank, n, store_dir)
    want = float(n * (n + 1) // 2)

    def work_wait():
        t = torch.full((4,), rank + 1.0)
        dist.all_reduce(t, async_op=True).wait()
        assert torch.equal(t, torch.full((4,), want))

    def bounded_work_wait():
        from datetime import timedelta

        t = torch.full((4,), rank + 1.0)
        dist.all_reduce(t, async_op=True).wait(timeout=timedelta(seconds=30))
        assert torch.equal(t, torch.full((4,), want))

    def is_completed():
        t = torch.full((4,), rank + 1.0)
        w = dist.all_reduce(t, async_op=True)
        while not w.is_completed():
            pass
        assert torch.equal(t, torch.full((4,), want))

    def future():
        t = torch.full((4,), rank + 1.0)
        fut = dist.all_reduce(t, async_op=True).get_future()
        assert torch.equal(fut.wait()[0], torch.full((4,), want))

    def coalesced():
        ts = [torch.full((3,), rank + 1.0 + k) for k in range(3)]
        with dist._coalescing_manager(async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t)
        cm.wait()
        for k, t in enumerate(ts):
            assert torch.equal(t, torch.full((3,), want + n * k))

    # Built before the clock runs: its first use imports and sets up much of torch.nn.parallel,
    # which takes seconds on a loaded machine. Its construction's broadcasts are waited calls.
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))

    def ddp():
        model(torch.full((2, 8), float(rank))).sum().backward()  # the reducer takes Futures
        g = model.module.weight.grad.clone()
        dist.all_reduce(g, op=dist.ReduceOp.MAX)  # the same gradient everywhere
        assert torch.equal(g, model.module.weight.grad)

    took = _time_each(
        dist.barrier,
        [
            ("Work.wait", work_wait),
            ("Work.wait(timeout)", bounded_work_wait),
            ("Work.is_completed polling", is_completed),
            ("get_future", future),
            ("coalesced", coalesced),
            ("DDP step", ddp),
        ],
    )
    dist.destroy_process_group()
    return took


@pytest.mark.parametrize("n", [1, 2])
def test_torch_native_starts(n, tmp_path, monkeypatch):
    pytest.importorskip("torch")

    from test_torch_backend import run_torch

    monkeypatch.setenv("PLAIT_ASYNC_GRACE_US", LONG["PLAIT_ASYNC_GRACE_US"])
    _none_stalled(run_torch(_torch_starts, n, tmp_path, timeout=120))
