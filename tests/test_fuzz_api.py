"""Bad input, fuzzed with hypothesis: rank 1 makes a call built from wrong shapes, dtypes, layouts,
out buffers, roots and peers while rank 0 makes an ordinary allreduce. Rank 1 must get a clear
plait error (InvalidArgument, or MismatchError when the draw happens to be a valid call of another
kind), never a crash or a stray Python exception, and rank 0 an error well before its deadline.
Example counts stay modest: each example forks two ranks."""

import gc
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plait
from conftest import run_ranks
from test_half_precision import run, to_f32, to_half
from test_run import _ENV

PEER_TIMEOUT = 5.0
SETTINGS = settings(
    max_examples=int(os.environ.get("PLAIT_FUZZ_EXAMPLES", 40)),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

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
        return {
            "exc": type(e).__name__,
            "msg": str(e),
            "t": time.monotonic() - t0,
            "plait": isinstance(e, plait.PlaitError),
        }
    return {"exc": None, "t": time.monotonic() - t0}


SPECS = st.fixed_dictionaries(
    {
        "coll": st.sampled_from(COLLS),
        "dtype": st.sampled_from(DTYPES),
        "shape": st.one_of(
            st.just(()), st.tuples(st.integers(0, 40)), st.tuples(st.integers(0, 6), st.integers(0, 6))
        ),
        "layout": st.sampled_from(("contiguous", "strided", "transposed", "read_only", "list")),
        "out": st.sampled_from(("same_kind", "wrong_size", "wrong_dtype", "read_only", "none")),
        "delta": st.integers(-3, 3).filter(bool),
        "int": st.one_of(st.integers(-3, 4), st.sampled_from((2**31, -(2**31) - 1, 2**63 - 1))),
    }
)


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
        r0["t"],
        spec,
        r0["msg"],
    )


# ---------------------------------------------------------------- bad deadlines

BAD_TIMEOUTS = st.one_of(
    st.floats(max_value=-1e-300),
    st.integers(max_value=-1),
    st.just(float("nan")),
    st.text(max_size=4),
    st.binary(max_size=2),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.complex_numbers(max_magnitude=10),
)


def bad_timeout_call(comm, coll, timeout, async_op):
    x, kw = np.ones(4 * comm.size, np.float32), {"timeout": timeout, "async_op": async_op}
    if coll == "send":
        return comm.send(x, 0, **kw)
    if coll == "barrier":
        return comm.barrier(**kw)
    return getattr(comm, coll)(x, **kw)


def _timeout_one(rank, n, store, coll, timeout, async_op):
    comm = plait.init(rank, n, store=store, timeout=PEER_TIMEOUT)
    t0 = time.monotonic()
    try:
        if rank == 1:
            h = bad_timeout_call(comm, coll, timeout, async_op)
            if async_op:
                h.wait()
        else:
            comm.allreduce(np.ones(16, np.float32))
        comm.barrier()
    except Exception as e:  # noqa: BLE001 - described to the parent
        return {"exc": type(e).__name__, "msg": str(e), "t": time.monotonic() - t0}
    return {"exc": None, "t": time.monotonic() - t0}


@SETTINGS
@given(
    coll=st.sampled_from(
        ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall", "barrier", "send")
    ),
    timeout=BAD_TIMEOUTS,
    async_op=st.booleans(),
)
def test_bad_timeout_is_refused_on_every_rank(coll, timeout, async_op):
    """A per-call timeout that is no number of seconds >= 0 is an InvalidArgument naming it, and
    the peers hear of it at once: it must never become "no deadline" (or the default one)."""
    r0, r1 = run_ranks(_timeout_one, 2, timeout=30, args=(coll, timeout, async_op))
    where = "%s timeout=%r async_op=%s" % (coll, timeout, async_op)
    assert r1["exc"] == "InvalidArgument" and "timeout" in r1["msg"], (where, r1)
    assert r0["exc"] == "InvalidArgument" and "rank 1" in r0["msg"], (where, r0)
    assert r0["t"] < PEER_TIMEOUT - 1.5, (where, r0)


# ---------------------------------------------------------------- half types in every algorithm


def _half_exact(rank, n, store, spec):
    """Every reducing algorithm on data whose float32 sums are exact: each must give the one
    closed-form answer, float32 sum (and divide) rounded once (see test_half_precision.py)."""
    dt, op, count = spec["dtype"], spec["op"], spec["count"]
    comm = plait.init(rank, n, store=store, timeout=30, buffer_bytes=8192)
    rng = np.random.default_rng([spec["seed"], 0])
    bits = 10 if dt == "float16" else 7
    ks = rng.integers(-(2**bits), 2**bits + 1, size=(n, n * count))
    exps = spec["exp"] + rng.integers(0, spec["spread"] + 1, size=(n, 1))
    xs = [to_half(ks[r] * np.exp2(exps[r]), dt) for r in range(n)]
    total = np.add.reduce(np.stack([to_f32(x, dt) for x in xs]), axis=0, dtype=np.float32)
    want = to_half(total / np.float32(n) if op == "avg" else total, dt)
    wrong = []
    for coll in ("allreduce", "reduce_scatter", "reduce"):
        for algo in plait.algorithms(coll):
            if algo in ("single_copy", "shared_or_staged") and not comm.single_copy:
                continue
            got = run(comm, coll, xs[rank].copy(), algo, op, dt)
            w = want[rank * count : (rank + 1) * count] if coll == "reduce_scatter" else want
            if got.tobytes() != w.tobytes():
                bad = np.flatnonzero(got != w)
                wrong.append(
                    "%s %s: %d differ, first [%d] got %r want %r"
                    % (coll, algo, bad.size, bad[0], got[bad[0]], w[bad[0]])
                )
    plait.finalize()
    return wrong


HALF_SPECS = st.one_of(
    st.fixed_dictionaries(
        {"dtype": st.just("float16"), "exp": st.integers(-10, -3), "spread": st.integers(0, 8)}
    ),
    st.fixed_dictionaries(
        {"dtype": st.just("bfloat16"), "exp": st.integers(-100, 100), "spread": st.integers(0, 12)}
    ),
).flatmap(
    lambda d: st.fixed_dictionaries(
        {
            **{k: st.just(v) for k, v in d.items()},
            "op": st.sampled_from(("sum", "avg")),
            "n": st.integers(2, 5),
            "count": st.integers(1, 1500),
            "seed": st.integers(0, 2**32 - 1),
        }
    )
)


@settings(SETTINGS, max_examples=max(1, SETTINGS.max_examples // 4))
@given(spec=HALF_SPECS)
def test_half_types_agree_in_every_algorithm(spec):
    """float16 values k * 2^e (|k| <= 2^10) and bfloat16 ones (|k| <= 2^7) with exponents within
    8 (12) of each other: at most 5 ranks, their float32 sums are exact, so every order of
    summation gives the same float32 value, and one rounding leaves a single right answer."""
    for rank, wrong in enumerate(run_ranks(_half_exact, spec["n"], timeout=120, args=(spec,))):
        assert not wrong, "rank %d, %s:\n  %s" % (rank, spec, "\n  ".join(wrong))


# ---------------------------------------------------------------- lifetime misuse


def _lifetime(rank, n, store):
    seen = {}
    comm = plait.init(rank, n, store=store, timeout=5)
    again = plait.init(rank, n, store=store, timeout=5)  # double init: replaces the default
    seen["old default closed"] = comm.closed
    again.allreduce(np.ones(4, np.float32))
    plait.finalize()
    for name, call in {
        "allreduce": lambda: again.allreduce(np.ones(4, np.float32)),
        "module barrier": lambda: plait.barrier(),
        "split": lambda: again.split(0),
        "finalize twice": lambda: (again.finalize(), plait.finalize()),
    }.items():
        t0 = time.monotonic()
        try:
            call()
            seen[name] = ("returned", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001
            seen[name] = (
                type(e).__name__ if isinstance(e, plait.PlaitError) else "foreign " + type(e).__name__,
                time.monotonic() - t0,
            )
    return seen


def test_double_init_and_calls_after_finalize():
    for seen in run_ranks(_lifetime, 2, timeout=60):
        assert seen.pop("old default closed") is True
        assert seen.pop("finalize twice")[0] == "returned"
        for name, (what, t) in seen.items():
            assert what == "PlaitError" and t < 1.0, (name, what, t)


# ---------------------------------------------------------------- init again after finalize

REINIT_ROUNDS = 4


def _reinit_rounds(rank, n, store, mode):
    """init / allreduce / finalize, REINIT_ROUNDS times. Some rounds hold one rank back around its
    finalize or init, so that peers start the next init while it still serves (or does not yet
    serve) the previous one: the orders in which a rank-0-served store used to break."""
    sums = []
    if mode.endswith("two_hosts"):
        os.environ["PLAIT_HOST_ID"] = "host%d" % (rank % 2)  # a HierCommunicator each round
    for k in range(REINIT_ROUNDS):
        if k == 3 and rank == 0:
            time.sleep(0.3)  # the others connect before rank 0 serves again
        comm = plait.init(rank, n, store=store, timeout=20) if mode == "store_arg" else plait.init(timeout=20)
        sums.append(comm.allreduce(np.full(8, rank + k, np.float32)).tolist())
        if (k == 0 and rank == 0) or (k == 1 and rank == n - 1):
            time.sleep(0.3)  # the others finalize and init again first
        plait.finalize()
    return sums


def free_port_pair():
    """A port p with p + 1 free too (rank 0 serves plait's store at MASTER_PORT + 1)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise RuntimeError("no free pair of ports")


@pytest.mark.parametrize("mode", ["rank0_serves", "rank0_serves_two_hosts", "plait_store", "store_arg"])
def test_init_again_after_finalize(mode):
    """Every launch mode: rank 0 serving the store at MASTER_PORT + 1 (torchrun-style, no
    PLAIT_STORE; on one host and on two simulated ones), a store named by PLAIT_STORE (plait-run,
    run_ranks), a store passed to init."""
    n = 3
    env = (
        {"PLAIT_STORE": None, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port_pair()}
        if mode.startswith("rank0_serves")
        else None
    )
    for rank, sums in enumerate(run_ranks(_reinit_rounds, n, timeout=90, args=(mode,), env=env)):
        for k, got in enumerate(sums):
            assert got == [float(sum(range(n)) + n * k)] * 8, (rank, k, got)
    assert len(sums) == REINIT_ROUNDS


REINIT_SCRIPT = """
import os, sys, time
import numpy as np
import plait
rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
for k in range(3):
    comm = plait.init(timeout=20)
    n = comm.size
    got = comm.allreduce(np.full(8, rank + k, np.float32))
    assert got.tolist() == [float(sum(range(n)) + n * k)] * 8, (rank, k, got)
    if k == 0 and rank == 0:
        time.sleep(0.3)
    plait.finalize()
with open(os.path.join(sys.argv[1], f"done-{rank}"), "w") as f:
    f.write("ok")
"""


def _reinit_launched(tmp_path, cmd, env, n):
    prog = tmp_path / "reinit.py"
    prog.write_text(REINIT_SCRIPT)
    r = subprocess.run(
        cmd + [sys.executable, str(prog), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert all((tmp_path / f"done-{rank}").exists() for rank in range(n))


def test_init_again_under_plait_run(tmp_path):
    _reinit_launched(tmp_path, [sys.executable, "-m", "plait.run", "-n", "2"], _ENV, 2)


def test_init_again_under_mpirun(tmp_path):
    """Under mpirun with no store named, rank 0 serves one on a fresh port per init and broadcasts
    its address over MPI."""
    if shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs mpirun and mpi4py")
    env = {
        k: v
        for k, v in _ENV.items()
        if k not in ("RANK", "WORLD_SIZE", "PLAIT_STORE", "MASTER_ADDR", "MASTER_PORT", "PLAIT_HOST_ID")
    }
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    _reinit_launched(tmp_path, cmd, env, 2)


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
