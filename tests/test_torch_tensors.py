"""plait's own API on torch CPU tensors: the small-message path that hands plait a tensor's memory
(address, bytes, dtype) without a numpy view, checked for every dtype, the collectives it serves,
in place and out of place, against closed-form results; and its refusals, raised on every rank.
"""

import pytest

torch = pytest.importorskip("torch")
import plait  # noqa: E402 - after the importorskip
from plait import _comm  # noqa: E402 - after the importorskip
from conftest import run_ranks  # noqa: E402 - after the importorskip

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
COUNTS = (1, 37, 9001)  # 9001 elements pass plait's 8 KiB staging in every dtype
CALL_TIMEOUT = 30


def _values(rank, count, dt):
    """Small integers: every sum over up to 4 ranks is exact in every dtype (bool: all True)."""
    v = (torch.arange(count, dtype=torch.int64) % 5 + 1) * (rank + 1)
    return v.to(dt) if dt is not torch.bool else torch.ones(count, dtype=torch.bool)


def _sum(n, count, dt):
    if dt is torch.bool:
        return torch.ones(count, dtype=torch.bool)
    return ((torch.arange(count, dtype=torch.int64) % 5 + 1) * (n * (n + 1) // 2)).to(dt)


def _worker(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT, buffer_bytes=4096)
    fast = []
    host = _comm._fast_host

    def counting(*args):
        fast.append(args[1])
        return host(*args)

    _comm._fast_host = counting
    wrong = []
    for name in DTYPES:
        dt = getattr(torch, name)
        for count in COUNTS:
            label = f"{name} count={count}"
            x = _values(rank, count, dt)
            out = comm.allreduce(x)  # out of place: a new tensor of x's kind
            if not torch.equal(out, _sum(n, count, dt)) or not torch.equal(x, _values(rank, count, dt)):
                wrong.append(f"allreduce {label}")
            comm.allreduce(x, out=x)  # in place
            if not torch.equal(x, _sum(n, count, dt)):
                wrong.append(f"allreduce in place {label}")
            blocks = torch.cat([_values(rank, count, dt)] * n)
            mine = torch.empty(count, dtype=dt)
            comm.reduce_scatter(blocks, out=mine)
            if not torch.equal(mine, _sum(n, count, dt)):
                wrong.append(f"reduce_scatter {label}")
            every = torch.empty(n * count, dtype=dt)
            comm.allgather(_values(rank, count, dt), out=every)
            want = torch.cat([_values(r, count, dt) for r in range(n)])
            if not torch.equal(every, want):
                wrong.append(f"allgather {label}")
            b = _values(rank, count, dt)
            comm.broadcast(b, root=n - 1)
            if not torch.equal(b, _values(n - 1, count, dt)):
                wrong.append(f"broadcast {label}")
    _comm._fast_host = host
    calls = len(fast)
    comm.finalize()
    return wrong, calls


@pytest.mark.parametrize("n", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_torch_cpu_tensors_take_the_pointer_path(n):
    results = run_ranks(_worker, n, timeout=240)
    for rank, (wrong, calls) in enumerate(results):
        assert not wrong, f"rank {rank}: {wrong}"
        # All five calls of every case took it (the out-of-place allreduce's output is a tensor too).
        assert calls == 5 * len(DTYPES) * len(COUNTS), f"rank {rank}: {calls} calls took the pointer path"


def _refusals(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
    seen = []
    # Each bad call aborts the communicator on every rank; a new one per case.
    cases = [
        ("too small", lambda c: c.allreduce(torch.ones(8), out=torch.empty(4))),
        ("dtypes differ", lambda c: c.allreduce(torch.ones(8), out=torch.empty(8, dtype=torch.float64))),
        ("not contiguous", lambda c: c.allreduce(torch.ones(8, 2)[:, 0])),
        ("unsupported dtype", lambda c: c.allreduce(torch.ones(4, dtype=torch.complex64))),
    ]
    for i, (what, call) in enumerate(cases):
        c = comm if i == 0 else plait.init(rank, n, store=store, timeout=CALL_TIMEOUT, set_default=False)
        bad = call if rank == 0 else (lambda c: c.allreduce(torch.ones(8), out=torch.empty(8)))
        try:
            bad(c)
            seen.append((what, None))
        except plait.PlaitError as e:
            seen.append((what, type(e).__name__, str(e)))
        c.finalize()
    return seen


def test_refusals_reach_every_rank():
    results = run_ranks(_refusals, 2, timeout=120)
    for rank, seen in enumerate(results):
        for what, *err in seen:
            assert err[0] == "InvalidArgument", f"rank {rank}, {what}: {err}"
            assert "rank 0" in err[1], (
                f"rank {rank}, {what}: the message names the rank that refused: {err[1]}"
            )
