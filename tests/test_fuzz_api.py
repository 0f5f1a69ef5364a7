"""Bad input, fuzzed with hypothesis: rank 1 makes a call built from wrong shapes, dtypes, layouts,
out buffers, roots and peers while rank 0 makes an ordinary allreduce. Rank 1 must get a clear
plait error (InvalidArgument, or MismatchError when the draw happens to be a valid call of another
kind), never a crash or a stray Python exception, and rank 0 an error well before its deadline.
Example counts stay modest: each example forks two ranks."""
import gc
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plait
from conftest import run_ranks

PEER_TIMEOUT = 5.0
SETTINGS = settings(max_examples=int(__import__("os").environ.get("PLAIT_FUZZ_EXAMPLES", 40)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

COLLS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall", "send", "recv")
DTYPES = ("float32", "int64", "uint16", "complex64", ">f4", "float16", "object", "U3", "bool")


def build(spec):
    dt = np.dtype(spec["dtype"])
    x = np.zeros(spec["shape"], dt) if dt.kind != "O" else np.array([None] * 4)
    if spec["layout"] == "strided" and x.ndim and x.shape[0] > 1:
        x = x[::2]
    elif spec["layout"] == "transposed" and x.ndim == 2:
        x = x.T
    elif spec["layout"] == "read_only":
        x.flags.writeable = False
    elif spec["layout"] == "list":
        x = x.tolist()
    out = spec["out"]
    if out == "wrong_size":
        out = np.zeros(max(0, x.size + spec["delta"]) if hasattr(x, "size") else 3, np.float32)
    elif out == "wrong_dtype":
        out = np.zeros(x.size if hasattr(x, "size") else 3, np.int8)
    elif out == "read_only":
        out = np.zeros(x.size if hasattr(x, "size") else 3, np.float32)
        out.flags.writeable = False
    elif out == "none":
        out = None
    return x, out


def bad_call(comm, spec):
    x, out = build(spec)
    c, arg = spec["coll"], spec["int"]
    if c in ("allreduce", "reduce_scatter", "allgather", "alltoall"):
        return getattr(comm, c)(x, out=out)
    if c in ("broadcast", "reduce"):
        return getattr(comm, c)(x, root=arg, out=out)
    if c == "send":
        return comm.send(x, arg)
    return comm.recv(x, arg)


def _fuzz_one(rank, n, store, spec):
    comm = plait.init(rank, n, store=store, timeout=PEER_TIMEOUT)
    t0 = time.monotonic()
    try:
        if rank == 1:
            bad_call(comm, spec)
        else:
            comm.allreduce(np.ones(16, np.float32))
        comm.barrier()  # a call that slipped through must still end in an error, not a hang
    except Exception as e:  # noqa: BLE001 - described to the parent
        return {"exc": type(e).__name__, "msg": str(e), "t": time.monotonic() - t0,
                "plait": isinstance(e, plait.PlaitError)}
    return {"exc": None, "t": time.monotonic() - t0}


SPECS = st.fixed_dictionaries({
    "coll": st.sampled_from(COLLS),
    "dtype": st.sampled_from(DTYPES),
    "shape": st.one_of(st.just(()), st.tuples(st.integers(0, 40)),
                       st.tuples(st.integers(0, 6), st.integers(0, 6))),
    "layout": st.sampled_from(("contiguous", "strided", "transposed", "read_only", "list")),
    "out": st.sampled_from(("same_kind", "wrong_size", "wrong_dtype", "read_only", "none")),
    "delta": st.integers(-3, 3).filter(bool),
    "int": st.one_of(st.integers(-3, 4), st.sampled_from((2**31, -2**31 - 1, 2**63 - 1))),
})


@SETTINGS
@given(spec=SPECS)
def test_bad_call_is_a_clear_error_and_no_hang(spec):
    if spec["out"] == "same_kind":
        spec = dict(spec, out="none")
    if spec["coll"] in ("send", "recv") and spec["int"] == 0:
        spec = dict(spec, int=1)  # peer 0 would make a valid call that waits out its deadline
    r1, r0 = None, None
    results = run_ranks(_fuzz_one, 2, timeout=30, args=(spec,))
    r0, r1 = results
    assert r1["exc"] is not None, "rank 1's call and barrier passed: %s" % spec
    assert r1["plait"], "rank 1: %s: %s (spec %s)" % (r1["exc"], r1["msg"], spec)
    assert r0["plait"], "rank 0: %s: %s (spec %s)" % (r0["exc"], r0.get("msg"), spec)
    assert r0["t"] < PEER_TIMEOUT - 1.5, "rank 0 heard after %.1f s (spec %s): %s" % (
        r0["t"], spec, r0["msg"])


# ---------------------------------------------------------------- lifetime misuse

def _lifetime(rank, n, store):
    seen = {}
    comm = plait.init(rank, n, store=store, timeout=5)
    again = plait.init(rank, n, store=store, timeout=5)  # double init: replaces the default
    seen["old default closed"] = comm.closed
    again.allreduce(np.ones(4, np.float32))
    plait.finalize()
    for name, call in {"allreduce": lambda: again.allreduce(np.ones(4, np.float32)),
                       "module barrier": lambda: plait.barrier(),
                       "split": lambda: again.split(0),
                       "finalize twice": lambda: (again.finalize(), plait.finalize())}.items():
        t0 = time.monotonic()
        try:
            call()
            seen[name] = ("returned", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001
            seen[name] = (type(e).__name__ if isinstance(e, plait.PlaitError) else "foreign " + type(e).__name__,
                          time.monotonic() - t0)
    return seen


def test_double_init_and_calls_after_finalize():
    for seen in run_ranks(_lifetime, 2, timeout=60):
        assert seen.pop("old default closed") is True
        assert seen.pop("finalize twice")[0] == "returned"
        for name, (what, t) in seen.items():
            assert what == "PlaitError" and t < 1.0, (name, what, t)


def _dropped_handles(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=10, buffer_bytes=8192)
    clobbered = 0
    for _ in range(20):
        if rank == 1:
            time.sleep(0.02)
        comm.allgather(np.full(1 << 12, 3.0, np.float32), async_op=True)  # handle dropped at once
        gc.collect()
        junk = [np.full(1 << 11, 7.0, np.float32) for _ in range(64)]  # would reuse a freed out
        comm.barrier()
        clobbered += sum(int((j != 7.0).sum()) for j in junk)
    return clobbered


@pytest.mark.slow
def test_dropped_async_handle_keeps_its_arrays_alive():
    """A Handle dropped before its call finishes must not let the call write into freed memory."""
    assert run_ranks(_dropped_handles, 2, timeout=60) == [0, 0]
