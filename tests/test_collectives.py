"""Correctness of every collective over world sizes 1, 2, 3, 4 and 8, every dtype, op and algorithm.

Inputs are integer-valued and come from a closed formula, so any summation order gives the same
result and results compare bit for bit with numpy in the same dtype (integers are scaled past
their range on purpose: plait's sums and products must wrap like numpy's). One spawn per
(world size, collective); the child loops over the combinations and collects wrong results
instead of stopping, so that the ranks stay in step. Ranks also return digests of results that
must be bitwise equal everywhere, and the parent compares them. 8 ranks share 2 cores here, so
their combinations are thinned to a covering subset.
"""

import hashlib
import itertools
import os
import random
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

import plait
from conftest import run_ranks

# 8 ranks oversubscribe the 2 cores: the full suite runs them, the fast tier (-m "not slow") not.
WORLD_SIZES = (1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow))
SMALL_BUFFER = 4096  # forces the multi-chunk paths (plait makes it its 8 KiB minimum)
# plait rounds buffer_bytes up to at least 8 KiB of staging: 9001 elements exceed it in every dtype.
COUNTS = (0, 1, 37, 9001)
CALL_TIMEOUT = 30
RUN_TIMEOUT = 240

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
FLOATS = ("float16", "bfloat16", "float32", "float64")
OPS = ("sum", "prod", "min", "max", "avg")
PAIRS = [(dt, op) for dt in DTYPES for op in (OPS if dt in FLOATS else OPS[:4])]

# Values 1..11 are mapped per dtype: floats are centred on zero, integers scaled so sums wrap.
_SCALE = {"int8": 23, "uint8": 23, "int32": 2**28 + 3, "int64": 2**60 + 7}
_OFFSET = {dt: -6 for dt in FLOATS}


# ---------------------------------------------------------------- data and exact references


def storage(dt):
    """The numpy dtype that holds dt (raw bfloat16 lives in uint16)."""
    return np.dtype(np.uint16) if dt == "bfloat16" else np.dtype(dt)


def dtype_kw(dt):
    return {"dtype": "bfloat16"} if dt == "bfloat16" else {}


def f32_to_bf16(a):
    """float32 -> bfloat16 bits, rounded to nearest even (our data has no NaNs)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(u):
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_compute(a, dt):
    """A stored dt array in the type plait accumulates it in (float32 for the half types)."""
    if dt == "bfloat16":
        return bf16_to_f32(a)
    return a.astype(np.float32) if dt == "float16" else a


def from_compute(a, dt):
    return f32_to_bf16(a) if dt == "bfloat16" else a.astype(storage(dt))


def data(r, count, dt, op="sum", salt=0):
    """x_r[i] = ((r + 1) * 3 + i * 7 + salt) % 11 + 1, mapped per dtype; prod uses values in
    {1, 2}; bool uses (r + i + salt) % 3 == 0."""
    i = np.arange(count, dtype=np.int64)
    if dt == "bool":
        return (r + i + salt) % 3 == 0
    if op == "prod":
        v = 1 + ((r * 5 + i * 3 + salt) % 4 == 0).astype(np.int64)
    else:
        v = ((r + 1) * 3 + i * 7 + salt) % 11 + 1
        v = v * _SCALE.get(dt, 1) + _OFFSET.get(dt, 0)
    if dt == "bfloat16":
        return f32_to_bf16(v.astype(np.float32))
    return v.astype(storage(dt))


def reduce_ref(arrays, dt, op):
    """The exact result of reducing the stored-dt arrays with op, as plait defines it: half types
    accumulate in float32 and round once; avg = sum / size in the accumulation type."""
    n = len(arrays)
    if dt == "bool":
        st = np.stack(arrays)
        return st.any(axis=0) if op in ("sum", "max") else st.all(axis=0)
    st = np.stack([to_compute(a, dt) for a in arrays])
    if op in ("sum", "avg"):
        res = np.add.reduce(st, axis=0, dtype=st.dtype)
        if op == "avg":
            res = res / np.array(n, dtype=st.dtype)
    elif op == "prod":
        res = np.multiply.reduce(st, axis=0, dtype=st.dtype)
    else:
        res = st.min(axis=0) if op == "min" else st.max(axis=0)
    return from_compute(res, dt)


def unaligned(a):
    """A copy of a that is C-contiguous but starts one byte past an element boundary."""
    buf = np.empty(a.nbytes + a.itemsize, np.uint8)
    out = buf[1 : 1 + a.nbytes].view(a.dtype)
    out[...] = a
    assert not out.flags.aligned and out.flags.c_contiguous
    return out


def random_floats(r, count, dt):
    """Inexact data: results cannot be predicted bit for bit, but must agree across ranks."""
    v = np.random.default_rng([r, count]).standard_normal(count)
    if dt == "float64":
        return v
    v = v.astype(np.float32)
    return f32_to_bf16(v) if dt == "bfloat16" else v.astype(storage(dt))


# ---------------------------------------------------------------- checking


def digest(a):
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


class Check:
    """Collects wrong results instead of raising at the first one (the ranks must stay in step)."""

    def __init__(self, rank):
        self.rank = rank
        self.wrong = []
        self.digests = {}

    def eq(self, label, got, want, *, same_on_all_ranks=False):
        if not isinstance(got, np.ndarray):
            self.wrong.append("%s: got %r, want an array" % (label, type(got)))
            return
        if got.dtype != want.dtype or got.shape != want.shape:
            self.wrong.append(
                "%s: got %s %s, want %s %s" % (label, got.dtype, got.shape, want.dtype, want.shape)
            )
        elif got.tobytes() != want.tobytes():
            g, w = np.ascontiguousarray(got).reshape(-1), np.ascontiguousarray(want).reshape(-1)
            bad = np.flatnonzero(
                (g.view(np.uint8).reshape(g.size, -1) != w.view(np.uint8).reshape(w.size, -1)).any(axis=1)
            )
            self.wrong.append(
                "%s: %d of %d elements differ; first [%d]: got %r, want %r"
                % (label, bad.size, g.size, bad[0], g[bad[0]], w[bad[0]])
            )
        if same_on_all_ranks:
            self.digests[label] = digest(got)

    def close(self, label, got, dt, want64, atol):
        got64 = to_compute(np.asarray(got), dt).astype(np.float64)
        if got64.shape != want64.shape:
            self.wrong.append("%s: shape %s, want %s" % (label, got64.shape, want64.shape))
        elif got64.size and np.abs(got64 - want64).max() > atol:
            self.wrong.append("%s: max error %g > %g" % (label, np.abs(got64 - want64).max(), atol))
        self.digests[label] = digest(got)

    def true(self, label, cond):
        if not cond:
            self.wrong.append(label)

    def done(self):
        if self.wrong:
            raise AssertionError(
                "rank %d: %d wrong result(s):\n  %s"
                % (self.rank, len(self.wrong), "\n  ".join(self.wrong[:20]))
            )
        return self.digests


@contextmanager
def case(label):
    """Names the combination in the traceback of an error raised by plait."""
    try:
        yield
    except Exception as e:
        e.add_note("while running: " + label)
        raise


def thin(cases, lean, keep):
    """All cases, or (lean) a subset covering every value of every field and every pair of the
    first field (the algorithm or root) with each other field, filled up to `keep` cases."""
    if not lean:
        return cases
    order = cases[:]
    random.Random(8).shuffle(order)
    seen, picked = set(), set()
    for c in order:
        feats = {(i, v) for i, v in enumerate(c)} | {(0, c[0], i, v) for i, v in enumerate(c)}
        if feats - seen:
            seen |= feats
            picked.add(c)
    for c in order:
        if len(picked) >= keep:
            break
        picked.add(c)
    return [c for c in cases if c in picked]


def reduce_cases(algos, lean, keep=160):
    """(algorithm, dtype, op, count, flag) over every algorithm, valid (dtype, op) and count; the
    flag alternates so that each (algorithm, dtype, op) runs both ways."""
    cases = [
        (a, dt, op, c, (ai + k + ci) % 2 == 1)
        for ai, a in enumerate(algos)
        for k, (dt, op) in enumerate(PAIRS)
        for ci, c in enumerate(COUNTS)
    ]
    return thin(cases, lean, keep)


def _label(*parts):
    return " ".join(str(p) for p in parts)


def boundary_cases(algos, n, lean):
    """Counts around the chunk edges of the 8 KiB staging buffer (and its halves) and around
    multiples of the world size, rotating the element size so every edge is hit in bytes."""
    counts = sorted(
        {
            n - 1,
            n,
            n + 1,
            3 * n + 1,
            511,
            512,
            513,
            1023,
            1024,
            1025,
            2047,
            2048,
            2049,
            4095,
            4096,
            4097,
            8191,
            8192,
            8193,
        }
        - {0}
    )
    dts = ("float32", "int8", "float64", "bfloat16")
    cases = [(a, dts[(ai + ci) % len(dts)], c) for ai, a in enumerate(algos) for ci, c in enumerate(counts)]
    return thin(cases, lean, 40)


# ---------------------------------------------------------------- bodies run on every rank


def body_allreduce(comm, lean, chk):
    n, rank = comm.size, comm.rank
    algos = list(plait.algorithms("allreduce")) + ["auto"]
    for algo, dt, op, count, inplace in reduce_cases(algos, lean):
        x = data(rank, count, dt, op)
        want = reduce_ref([data(r, count, dt, op) for r in range(n)], dt, op)
        label = _label(
            "allreduce", algo, dt, op, "count=%d" % count, "in-place" if inplace else "out-of-place"
        )
        with case(label):
            if inplace:
                got = comm.allreduce(x, out=x, op=op, algorithm=algo, **dtype_kw(dt))
                chk.true(label + ": did not return out", got is x)
            else:
                x0 = x.copy()
                out = np.empty_like(x) if (len(dt) + count) % 2 else None
                got = comm.allreduce(x, out, op=op, algorithm=algo, **dtype_kw(dt))
                chk.true(label + ": did not return out", out is None or got is out)
                chk.eq(label + " (input changed)", x, x0)
        chk.eq(label, got, want, same_on_all_ranks=True)

    for algo, dt, count in boundary_cases(algos, n, lean):
        label = _label("allreduce edge", algo, dt, "count=%d" % count)
        with case(label):
            got = comm.allreduce(data(rank, count, dt), algorithm=algo, **dtype_kw(dt))
        chk.eq(
            label, got, reduce_ref([data(r, count, dt) for r in range(n)], dt, "sum"), same_on_all_ranks=True
        )

    # Every (dtype, op) at counts around SIMD vector and block widths, so that the kernels'
    # vector bodies and scalar tails both run (one_shot reduces all ranks in one kernel call).
    tails = (15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 257, 1000)
    for algo, (dt, op), count in thin(list(itertools.product(("one_shot", "ring"), PAIRS, tails)), lean, 60):
        label = _label("allreduce kernel widths", algo, dt, op, "count=%d" % count)
        with case(label):
            got = comm.allreduce(data(rank, count, dt, op), op=op, algorithm=algo, **dtype_kw(dt))
        chk.eq(
            label, got, reduce_ref([data(r, count, dt, op) for r in range(n)], dt, op), same_on_all_ranks=True
        )

    # Arrays that are contiguous but not aligned to their element size (a 1-byte offset).
    for algo in algos:
        for dt in ("float32", "float64", "int64", "bfloat16"):
            x = unaligned(data(rank, 1001, dt))
            out = unaligned(np.zeros(1001, storage(dt)))
            label = _label("allreduce unaligned", algo, dt)
            with case(label):
                got = comm.allreduce(x, out, algorithm=algo, **dtype_kw(dt))
            chk.eq(label, got, reduce_ref([data(r, 1001, dt) for r in range(n)], dt, "sum"))

    x = data(rank, 12, "int32").reshape(3, 4)
    want = reduce_ref([data(r, 12, "int32") for r in range(n)], "int32", "sum").reshape(3, 4)
    chk.eq("allreduce 2-D keeps its shape", comm.allreduce(x), want)

    atol = {"float16": 1e-2, "bfloat16": 6e-2, "float32": 2e-6, "float64": 1e-14}
    for algo, dt, op, count in thin(
        list(itertools.product(algos, FLOATS, ("sum", "avg", "max"), (37, 5001))), lean, 24
    ):
        xs = [random_floats(r, count, dt) for r in range(n)]
        label = _label("allreduce inexact", algo, dt, op, "count=%d" % count)
        with case(label):
            got = comm.allreduce(xs[rank].copy(), op=op, algorithm=algo, **dtype_kw(dt))
        if op == "max":
            chk.eq(label, got, reduce_ref(xs, dt, op), same_on_all_ranks=True)
        else:
            vals = np.stack([to_compute(a, dt).astype(np.float64) for a in xs])
            want64 = vals.sum(axis=0) / (n if op == "avg" else 1)
            chk.close(label, got, dt, want64, atol[dt] * n)


def body_reduce_scatter(comm, lean, chk):
    n, rank = comm.size, comm.rank
    algos = list(plait.algorithms("reduce_scatter")) + ["auto"]
    for algo, dt, op, count, provide in reduce_cases(algos, lean):
        x = data(rank, count * n, dt, op)
        x0 = x.copy()
        full = reduce_ref([data(r, count * n, dt, op) for r in range(n)], dt, op)
        want = full[rank * count : (rank + 1) * count]
        label = _label(
            "reduce_scatter", algo, dt, op, "count=%d" % count, "out given" if provide else "out=None"
        )
        out = np.empty(count, storage(dt)) if provide else None
        with case(label):
            got = comm.reduce_scatter(x, out, op=op, algorithm=algo, **dtype_kw(dt))
        chk.true(label + ": did not return out", out is None or got is out)
        chk.eq(label, got, want)
        chk.eq(label + " (input changed)", x, x0)

    for algo, dt, count in boundary_cases(algos, n, lean):
        label = _label("reduce_scatter edge", algo, dt, "count=%d" % count)
        full = reduce_ref([data(r, count * n, dt, "max") for r in range(n)], dt, "max")
        with case(label):
            got = comm.reduce_scatter(
                data(rank, count * n, dt, "max"), op="max", algorithm=algo, **dtype_kw(dt)
            )
        chk.eq(label, got, full[rank * count : (rank + 1) * count])


def body_allgather(comm, lean, chk):
    n, rank = comm.size, comm.rank
    algos = list(plait.algorithms("allgather")) + ["auto"]
    cases = [
        (a, dt, c, (ai + k + ci) % 2 == 1)
        for ai, a in enumerate(algos)
        for k, dt in enumerate(DTYPES)
        for ci, c in enumerate(COUNTS)
    ]
    for algo, dt, count, provide in thin(cases, lean, 60):
        x = data(rank, count, dt, salt=3)
        want = np.stack([data(r, count, dt, salt=3) for r in range(n)])
        label = _label("allgather", algo, dt, "count=%d" % count, "out given" if provide else "out=None")
        out = np.empty(n * count, storage(dt)) if provide else None
        with case(label):
            got = comm.allgather(x, out, algorithm=algo, **dtype_kw(dt))
        chk.true(label + ": did not return out", out is None or got is out)
        chk.eq(label, got, want.reshape(-1) if provide else want, same_on_all_ranks=True)

    for algo, dt, count in boundary_cases(algos, n, lean):
        label = _label("allgather edge", algo, dt, "count=%d" % count)
        with case(label):
            got = comm.allgather(data(rank, count, dt, salt=1), algorithm=algo, **dtype_kw(dt))
        chk.eq(label, got, np.stack([data(r, count, dt, salt=1) for r in range(n)]), same_on_all_ranks=True)

    for algo in algos:
        x, out = unaligned(data(rank, 999, "int32")), unaligned(np.zeros(999 * n, np.int32))
        with case("allgather unaligned " + algo):
            got = comm.allgather(x, out, algorithm=algo)
        chk.eq("allgather unaligned " + algo, got, np.concatenate([data(r, 999, "int32") for r in range(n)]))

    x = data(rank, 6, "int64").reshape(2, 3)
    want = np.stack([data(r, 6, "int64").reshape(2, 3) for r in range(n)])
    chk.eq("allgather 2-D: default out shape (size, *x.shape)", comm.allgather(x), want)


def body_broadcast(comm, lean, chk):
    n, rank = comm.size, comm.rank
    algos = list(plait.algorithms("broadcast")) + ["auto"]
    assert algos[:2] == ["direct", "single_copy"]
    cases = [
        (root, algos[(root + k + ci) % len(algos)], dt, c, (root + k + ci // 3) % 2)
        for root in range(n)
        for k, dt in enumerate(DTYPES)
        for ci, c in enumerate(COUNTS)
    ]
    for root, algo, dt, count, mode in thin(cases, lean, 96):
        x = data(rank, count, dt, salt=root)
        want = data(root, count, dt, salt=root)
        label = _label(
            "broadcast root=%d" % root, algo, dt, "count=%d" % count, "into x" if mode == 0 else "into out"
        )
        with case(label):
            if mode == 0:
                got = comm.broadcast(x, root, algorithm=algo, **dtype_kw(dt))
                chk.true(label + ": did not return x", got is x)
            else:
                x0, out = x.copy(), np.empty_like(x)
                got = comm.broadcast(x, root, out=out, algorithm=algo, **dtype_kw(dt))
                chk.true(label + ": did not return out", got is out)
                chk.eq(label + " (x changed)", x, x0)
        chk.eq(label, got, want, same_on_all_ranks=True)


def body_reduce(comm, lean, chk):
    n, rank = comm.size, comm.rank
    algos = list(plait.algorithms("reduce")) + ["auto"]
    assert algos[:2] == ["direct", "single_copy"]
    cases = [
        (root, algos[(root + k) % len(algos)], dt, op, COUNTS[(root + k) % len(COUNTS)], (root + k // 3) % 3)
        for root in range(n)
        for k, (dt, op) in enumerate(PAIRS)
    ]
    for root, algo, dt, op, count, mode in thin(cases, lean, 96):
        x = data(rank, count, dt, op)
        x0 = x.copy()
        want = reduce_ref([data(r, count, dt, op) for r in range(n)], dt, op)
        out = None
        if rank == root:
            out = (None, np.empty_like(x), x)[mode]
        label = _label(
            "reduce root=%d" % root,
            algo,
            dt,
            op,
            "count=%d" % count,
            ("out=None", "out given", "in place")[mode],
        )
        with case(label):
            got = comm.reduce(x, root, out=out, op=op, algorithm=algo, **dtype_kw(dt))
        if rank == root:
            chk.true(label + ": did not return out", out is None or got is out)
            chk.eq(label, got, want)
        else:
            chk.true(label + ": non-root got %r, want None" % type(got), got is None)
        if out is not x:
            chk.eq(label + " (input changed)", x, x0)


def body_alltoall(comm, lean, chk):
    n, rank = comm.size, comm.rank
    algos = list(plait.algorithms("alltoall")) + ["auto"]
    assert algos[:2] == ["direct", "single_copy"]
    cases = [
        (algos[(k + ci) % len(algos)], dt, c, (k + ci // 2) % 3)
        for k, dt in enumerate(DTYPES)
        for ci, c in enumerate(COUNTS)
    ]
    cases += [(a, "int32", 70_001, mode) for a in algos for mode in range(3)]  # > one chunk
    for algo, dt, count, mode in thin(cases, lean, 45):
        # block j of rank r's input holds data(r * n + j); it must land in block r of rank j.
        x = np.concatenate([data(rank * n + j, count, dt, salt=5) for j in range(n)])
        x0 = x.copy()
        want = np.concatenate([data(j * n + rank, count, dt, salt=5) for j in range(n)])
        out = (None, np.empty_like(x), x)[mode]
        label = _label("alltoall", algo, dt, "count=%d" % count, ("out=None", "out given", "in place")[mode])
        with case(label):
            got = comm.alltoall(x, out, algorithm=algo, **dtype_kw(dt))
        chk.true(label + ": did not return out", out is None or got is out)
        chk.eq(label, np.asarray(got).reshape(-1), want)
        if mode != 2:
            chk.eq(label + " (input changed)", x, x0)


def body_sendrecv(comm, lean, chk):
    n, rank = comm.size, comm.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    cases = [(dt, c) for dt in DTYPES for c in COUNTS]
    for tag, (dt, count) in enumerate(thin(cases, lean, 36)):
        # Ring with blocking calls: even ranks send first, odd ranks receive first.
        x = data(rank, count, dt, salt=tag)
        out = np.empty(count, storage(dt))
        label = _label("ring send/recv", dt, "count=%d" % count, "tag=%d" % tag)
        with case(label):
            if rank % 2 == 0:
                sent = comm.send(x, right, tag=tag, **dtype_kw(dt))
                got = comm.recv(out, left, tag=tag, **dtype_kw(dt))
            else:
                got = comm.recv(out, left, tag=tag, **dtype_kw(dt))
                sent = comm.send(x, right, tag=tag, **dtype_kw(dt))
        chk.true(label + ": send returned %r" % (sent,), sent is None)
        chk.true(label + ": recv did not return out", got is out)
        chk.eq(label, out, data(left, count, dt, salt=tag))

    # Pairs (2k, 2k+1) exchange several tagged messages in order, then echo them back.
    peer = rank ^ 1
    if peer < n:
        for tag in (0, 7, 123):
            x = data(rank, 5001, "float64", salt=tag)
            out = np.empty_like(x)
            label = "pair %d<->%d tag=%d" % (rank, peer, tag)
            with case(label):
                if rank % 2 == 0:
                    comm.send(x, peer, tag=tag)
                    comm.recv(out, peer, tag=tag)
                    chk.eq(label + " echo", out, data(rank, 5001, "float64", salt=tag) * 2)
                else:
                    comm.recv(out, peer, tag=tag)
                    chk.eq(label, out, data(peer, 5001, "float64", salt=tag))
                    comm.send(out * 2, peer, tag=tag)

    # Async send and receive in both directions at once (every rank sends right, receives left),
    # waited in different orders on different ranks; both must finish without deadlock.
    for count, dt in ((5001, "int32"), (1, "bfloat16"), (0, "uint8")):
        x = data(rank, count, dt, salt=11)
        out = np.empty(count, storage(dt))
        label = _label("async ring", dt, "count=%d" % count)
        with case(label):
            hs = comm.send(x, right, tag=11, async_op=True, **dtype_kw(dt))
            hr = comm.recv(out, left, tag=11, async_op=True, **dtype_kw(dt))
            if rank % 2:
                got, sent = hr.wait(), hs.wait()
            else:
                sent, got = hs.wait(), hr.wait()
        chk.true(label + ": handles not done after wait", hs.done() and hr.done())
        chk.true(label + ": recv handle did not return out", got is out)
        chk.true(label + ": send handle returned %r" % (sent,), sent is None)
        chk.eq(label, out, data(left, count, dt, salt=11))

    # Several outstanding messages per pair, posted before any receive, waited in reverse.
    if peer < n:
        xs = [data(rank, 3001, "float32", salt=t) for t in (21, 22, 23)]
        outs = [np.empty(3001, np.float32) for _ in xs]
        with case("pair %d<->%d: three outstanding isends and irecvs" % (rank, peer)):
            hs = [comm.send(x, peer, tag=t, async_op=True) for x, t in zip(xs, (21, 22, 23))]
            hr = [comm.recv(o, peer, tag=t, async_op=True) for o, t in zip(outs, (21, 22, 23))]
            for h in reversed(hs + hr):
                h.wait()
        for o, t in zip(outs, (21, 22, 23)):
            chk.eq("pair outstanding tag=%d" % t, o, data(peer, 3001, "float32", salt=t))


def body_barrier(comm, lean, chk):
    n, rank = comm.size, comm.rank
    times = []
    for it in range(2 * n):
        if rank == it % n:
            time.sleep(0.02)  # the late rank changes every round
        t_in = time.monotonic()
        with case("barrier round %d" % it):
            res = comm.barrier() if it % 2 else comm.barrier(timeout=20)
        times.append((t_in, time.monotonic()))
        chk.true("barrier returned %r" % (res,), res is None)
    with case("async barrier"):
        h = comm.barrier(async_op=True)
        chk.true("async barrier wait() returned non-None", h.wait() is None)
    return {"times": times}


def wait_rotated(chk, hs, rank, label):
    """Waits for handles hs last-issued first, rotated by rank so that ranks wait in different
    orders (odd ones with a timeout); their results, and a check that each reports done()."""
    order = list(range(len(hs)))[::-1]
    order = order[rank % len(order) :] + order[: rank % len(order)]
    res = [None] * len(hs)
    with case("%s: wait in order %s" % (label, order)):
        for i in order:
            res[i] = hs[i].wait(timeout=CALL_TIMEOUT) if i % 2 else hs[i].wait()
    chk.true("%s: a handle is not done() after wait()" % label, all(h.done() for h in hs))
    return res


def body_async(comm, lean, chk):
    n, rank = comm.size, comm.rank
    for rnd in range(1 if lean else 3):
        a = [data(rank, 5001, "float32", salt=rnd * 10 + s) for s in range(3)]
        b = data(rank, 37, "int64", salt=rnd)
        c = data(rank, 9001, "uint8", salt=rnd)
        d = data(rank, 101 * n, "float64", salt=rnd)
        e = np.concatenate([data(rank * n + j, 7, "int8", salt=rnd) for j in range(n)])
        f = data(rank, 5001, "int32", salt=rnd)
        with case("async round %d: issue" % rnd):
            hs = [comm.allreduce(arr, out=arr, async_op=True) for arr in a]
            hs.append(comm.allgather(b, async_op=True))
            hs.append(comm.broadcast(c, root=n - 1, async_op=True))
            hs.append(comm.reduce_scatter(d, op="max", async_op=True))
            hs.append(comm.alltoall(e, async_op=True))
            hs.append(comm.reduce(f, root=0, op="min", async_op=True))
            hs.append(comm.barrier(async_op=True))
        res = wait_rotated(chk, hs, rank, "async round %d" % rnd)
        for s, arr in enumerate(a):
            want = reduce_ref(
                [data(r, 5001, "float32", salt=rnd * 10 + s) for r in range(n)], "float32", "sum"
            )
            chk.eq("async allreduce %d.%d" % (rnd, s), arr, want, same_on_all_ranks=True)
            chk.true("async allreduce %d.%d: wait() did not return out" % (rnd, s), res[s] is arr)
        chk.eq(
            "async allgather %d" % rnd, res[3], np.stack([data(r, 37, "int64", salt=rnd) for r in range(n)])
        )
        chk.eq("async broadcast %d" % rnd, c, data(n - 1, 9001, "uint8", salt=rnd))
        full = reduce_ref([data(r, 101 * n, "float64", salt=rnd) for r in range(n)], "float64", "max")
        chk.eq("async reduce_scatter %d" % rnd, res[5], full[rank * 101 : (rank + 1) * 101])
        chk.eq(
            "async alltoall %d" % rnd,
            np.asarray(res[6]).reshape(-1),
            np.concatenate([data(j * n + rank, 7, "int8", salt=rnd) for j in range(n)]),
        )
        if rank == 0:
            chk.eq(
                "async reduce %d" % rnd,
                res[7],
                reduce_ref([data(r, 5001, "int32", salt=rnd) for r in range(n)], "int32", "min"),
            )
        else:
            chk.true("async reduce on a non-root returned %r" % type(res[7]), res[7] is None)
        chk.true("async barrier returned %r" % (res[8],), res[8] is None)

    # One async call per allreduce algorithm, all outstanding at once.
    algos = list(plait.algorithms("allreduce")) + ["auto"]
    xs = [data(rank, 777, "bfloat16", salt=k) for k in range(len(algos))]
    with case("async allreduce per algorithm"):
        hs = [
            comm.allreduce(x, op="max", algorithm=a, async_op=True, dtype="bfloat16")
            for x, a in zip(xs, algos)
        ]
        got = [h.wait() for h in hs[::-1]][::-1]
    for k, a in enumerate(algos):
        want = reduce_ref([data(r, 777, "bfloat16", salt=k) for r in range(n)], "bfloat16", "max")
        chk.eq("async allreduce algorithm=%s" % a, got[k], want, same_on_all_ranks=True)

    # Many handles outstanding at once, waited in a different random order on every rank.
    hs, want = [], []
    for k in range(24):
        algo, dt = algos[k % len(algos)], ("float32", "int8", "bfloat16")[k % 3]
        x = data(rank, 100 + 97 * k, dt, salt=k)
        hs.append(comm.allreduce(x, out=x, algorithm=algo, async_op=True, **dtype_kw(dt)))
        want.append(reduce_ref([data(r, 100 + 97 * k, dt, salt=k) for r in range(n)], dt, "sum"))
    order = list(range(len(hs)))
    random.Random(rank).shuffle(order)
    got = [None] * len(hs)
    with case("24 outstanding allreduces waited in order %s" % order):
        for k in order:
            got[k] = hs[k].wait()
    for k in range(len(hs)):
        chk.eq("outstanding allreduce %d" % k, got[k], want[k], same_on_all_ranks=True)

    # A blocking call made while an async one is outstanding runs after it.
    x = data(rank, 5001, "int64", salt=1)
    with case("blocking allgather behind an outstanding allreduce"):
        h = comm.allreduce(x, out=x, op="max", async_op=True)
        g = comm.allgather(data(rank, 37, "int8"))
        h.wait()
    chk.eq(
        "allreduce issued before a blocking call",
        x,
        reduce_ref([data(r, 5001, "int64", salt=1) for r in range(n)], "int64", "max"),
    )
    chk.eq("blocking call behind an async one", g, np.stack([data(r, 37, "int8") for r in range(n)]))

    # done() turns True without anyone calling wait() (the torch backend relies on it).
    x = data(rank, 5001, "float64")
    with case("async done() polling"):
        h = comm.allreduce(x, async_op=True)
        deadline = time.monotonic() + 10
        while not h.done() and time.monotonic() < deadline:
            time.sleep(1e-4)
        chk.true("done() still False 10 s after every rank issued the call", h.done())
        got = h.wait()
    chk.eq(
        "async done() polling",
        got,
        reduce_ref([data(r, 5001, "float64") for r in range(n)], "float64", "sum"),
    )


def body_split(comm, lean, chk):
    n, rank = comm.size, comm.rank
    # Even/odd colours; key n - rank reverses the order inside each colour.
    color = rank % 2
    with case("split(rank % 2, key=n - rank)"):
        sub = comm.split(color, key=n - rank)
    members = sorted((r for r in range(n) if r % 2 == color), key=lambda r: (n - r, r))
    chk.true("split: got %r, want a Communicator" % (sub,), sub is not None)
    if sub is not None:
        chk.true(
            "split: size %d rank %d, want %d %d" % (sub.size, sub.rank, len(members), members.index(rank)),
            (sub.size, sub.rank) == (len(members), members.index(rank)),
        )
        with case("collectives on the even/odd sub-communicator"):
            ranks = sub.allgather(np.array([rank], np.int64))
            x = data(rank, 5001, "int32")
            got = sub.allreduce(x)
            b = sub.broadcast(data(rank, 37, "float64"), root=0)
            sub.barrier()
        chk.eq("split allgather of old ranks", ranks.reshape(-1), np.array(members, np.int64))
        chk.eq(
            "split allreduce",
            got,
            reduce_ref([data(r, 5001, "int32") for r in members], "int32", "sum"),
            same_on_all_ranks=False,
        )
        chk.eq("split broadcast from sub-rank 0", b, data(members[0], 37, "float64"))
        sub.finalize()

    # Colour None (rank 0) and negative (rank 1) are not members.
    color = None if rank == 0 else (-1 if rank == 1 else 3)
    with case("split(None / -1 / 3)"):
        sub = comm.split(color)
    if rank < 2:
        chk.true("split(%r) returned %r, want None" % (color, sub), sub is None)
    else:
        chk.true("split(3): size/rank", sub is not None and (sub.size, sub.rank) == (n - 2, rank - 2))
        if sub is not None:
            with case("allreduce on split(3)"):
                got = sub.allreduce(np.ones(9, np.int64))
            chk.eq("allreduce on split(3)", got, np.full(9, n - 2, np.int64))
            sub.finalize()

    # Equal keys keep the parent's order; the parent stays usable after splitting.
    with case("split(0) with equal keys"):
        sub = comm.split(0)
        chk.true("split(0): rank %d, want %d" % (sub.rank, rank), (sub.size, sub.rank) == (n, rank))
        got = sub.allreduce(data(rank, 37, "float32"), op="max")
        sub.finalize()
        parent = comm.allreduce(np.ones(7, np.int64))
    chk.eq(
        "split(0) allreduce", got, reduce_ref([data(r, 37, "float32") for r in range(n)], "float32", "max")
    )
    chk.eq("parent after split", parent, np.full(7, n, np.int64))


def body_threads(comm, lean, chk):
    """Two communicators (the world and a reversed copy) driven from two threads at once."""
    n, rank = comm.size, comm.rank
    with case("split(0, key=-rank)"):
        sub = comm.split(0, key=-rank)
    iters = 8 if lean else 25
    errors = []

    def world():
        try:
            for i in range(iters):
                got = comm.allreduce(data(rank, 3001, "float32", salt=i))
                chk.eq(
                    "thread world allreduce %d" % i,
                    got,
                    reduce_ref([data(r, 3001, "float32", salt=i) for r in range(n)], "float32", "sum"),
                )
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append("world thread: %r" % e)

    def reversed_copy():
        try:
            for i in range(iters):
                got = sub.allgather(data(sub.rank, 1001, "int64", salt=i))
                chk.eq(
                    "thread sub allgather %d" % i,
                    got,
                    np.stack([data(j, 1001, "int64", salt=i) for j in range(n)]),
                )
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append("sub thread: %r" % e)

    threads = [threading.Thread(target=world), threading.Thread(target=reversed_copy)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RUN_TIMEOUT)
    if any(t.is_alive() for t in threads):
        raise AssertionError("rank %d: a thread is still inside a collective" % rank)
    assert not errors, "rank %d: %s" % (rank, errors)
    chk.true("split(0, key=-rank): rank %d, want %d" % (sub.rank, n - 1 - rank), sub.rank == n - 1 - rank)
    sub.finalize()


def body_default_buffer(comm, lean, chk):
    """The default 4 MiB staging buffer, with sizes around and above it."""
    n, rank = comm.size, comm.rank
    big = 600_001 if lean else 1_100_001  # 1.1 M float32 = 4.4 MB > 4 MiB
    algos = list(plait.algorithms("allreduce")) + ["auto"]
    cases = [
        (a, dt, op, c)
        for a in algos
        for dt, op in (("float32", "sum"), ("bfloat16", "max"), ("int64", "sum"))
        for c in (1, 37, 70_001)
    ]
    cases += [(a, "float32", "sum", big) for a in algos]
    for algo, dt, op, count in thin(cases, lean, 16):
        label = _label("default buffer allreduce", algo, dt, op, "count=%d" % count)
        with case(label):
            got = comm.allreduce(data(rank, count, dt, op), op=op, algorithm=algo, **dtype_kw(dt))
        chk.eq(
            label, got, reduce_ref([data(r, count, dt, op) for r in range(n)], dt, op), same_on_all_ranks=True
        )
    per = big // n
    for algo in list(plait.algorithms("reduce_scatter")) + ["auto"]:
        label = "default buffer reduce_scatter %s count=%d" % (algo, per)
        with case(label):
            got = comm.reduce_scatter(data(rank, per * n, "float32"), algorithm=algo)
        full = reduce_ref([data(r, per * n, "float32") for r in range(n)], "float32", "sum")
        chk.eq(label, got, full[rank * per : (rank + 1) * per])
    for algo in list(plait.algorithms("allgather")) + ["auto"]:
        label = "default buffer allgather %s count=%d" % (algo, per)
        with case(label):
            got = comm.allgather(data(rank, per, "int32"), algorithm=algo)
        chk.eq(label, got, np.stack([data(r, per, "int32") for r in range(n)]), same_on_all_ranks=True)
    with case("default buffer broadcast/alltoall"):
        b = comm.broadcast(data(rank, big, "float32"), root=n - 1)
        a = comm.alltoall(np.concatenate([data(rank * n + j, per, "int8") for j in range(n)]))
    chk.eq("default buffer broadcast", b, data(n - 1, big, "float32"), same_on_all_ranks=True)
    chk.eq(
        "default buffer alltoall",
        np.asarray(a).reshape(-1),
        np.concatenate([data(j * n + rank, per, "int8") for j in range(n)]),
    )


def body_kernels(comm, lean, chk):
    """Every (dtype, op) through every reduction kernel width, for the ISA-capped runs."""
    n, rank = comm.size, comm.rank
    tails = (1, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 257, 1000, 9001)
    for k, ((dt, op), count) in enumerate(itertools.product(PAIRS, tails)):
        algo = ("one_shot", "ring", "tree")[k % 3]
        label = _label("allreduce", algo, dt, op, "count=%d" % count)
        with case(label):
            got = comm.allreduce(data(rank, count, dt, op), op=op, algorithm=algo, **dtype_kw(dt))
        chk.eq(
            label, got, reduce_ref([data(r, count, dt, op) for r in range(n)], dt, op), same_on_all_ranks=True
        )
    return plait.build_info()["reduce_isa"]


BODIES = {
    "allreduce": body_allreduce,
    "reduce_scatter": body_reduce_scatter,
    "allgather": body_allgather,
    "broadcast": body_broadcast,
    "reduce": body_reduce,
    "alltoall": body_alltoall,
    "sendrecv": body_sendrecv,
    "barrier": body_barrier,
    "async": body_async,
    "split": body_split,
    "threads": body_threads,
    "default_buffer": body_default_buffer,
    "kernels": body_kernels,
}


def _worker(rank, n, store, name, lean, buffer_bytes):
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT, buffer_bytes=buffer_bytes)
    with comm:
        assert (comm.rank, comm.size) == (rank, n)
        chk = Check(rank)
        extra = BODIES[name](comm, lean, chk)
        return {"digests": chk.done(), "extra": extra}


def _same_on_all_ranks(results):
    wrong = []
    for label in results[0]["digests"]:
        found = [res["digests"].get(label) for res in results]
        if len(set(found)) != 1:
            groups = {}
            for rank, h in enumerate(found):
                groups.setdefault(h, []).append(rank)
            wrong.append("%s: ranks differ bitwise, groups %s" % (label, sorted(groups.values())))
    assert not wrong, "\n".join(wrong[:20])


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("name", [k for k in BODIES if k not in ("default_buffer", "kernels")])
@pytest.mark.parametrize("n", WORLD_SIZES, ids=lambda n: "n%d" % n)
def test_collective(n, name):
    if name == "sendrecv" and n == 1:
        pytest.skip("send/recv need a peer")
    results = run_ranks(_worker, n, timeout=RUN_TIMEOUT, args=(name, n >= 8, SMALL_BUFFER))
    _same_on_all_ranks(results)
    if name == "barrier":
        rounds = zip(*(res["extra"]["times"] for res in results))
        for it, times in enumerate(rounds):
            last_in = max(t_in for t_in, _ in times)
            first_out = min(t_out for _, t_out in times)
            assert first_out >= last_in, (
                "barrier round %d: a rank left %.6f s before the last rank arrived"
                % (it, last_in - first_out)
            )


@pytest.mark.parametrize("n", WORLD_SIZES, ids=lambda n: "n%d" % n)
def test_default_buffer(n):
    results = run_ranks(_worker, n, timeout=RUN_TIMEOUT, args=("default_buffer", n >= 8, None))
    _same_on_all_ranks(results)


def _kernels_main(isa):
    """Entry point of the fresh interpreter test_reduce_kernels_per_isa starts."""
    results = run_ranks(_worker, 3, timeout=RUN_TIMEOUT, args=("kernels", False, SMALL_BUFFER))
    _same_on_all_ranks(results)
    print("reduce_isa=%s" % results[0]["extra"])


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_reduce_kernels_per_isa(isa):
    """PLAIT_REDUCE_ISA caps the reduction kernels, so each one is checked on this machine. The
    choice is made once per process, so the ranks are forked from a fresh interpreter."""
    code = "import sys; sys.path.insert(0, %r); import test_collectives as t; t._kernels_main(%r)"
    proc = subprocess.run(
        [sys.executable, "-c", code % (os.path.dirname(__file__), isa)],
        env=dict(os.environ, PLAIT_REDUCE_ISA=isa),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    used = re.search(r"reduce_isa=(\w+)", proc.stdout).group(1)
    if used != isa:
        pytest.skip("this CPU cannot run the %s kernels (got %s)" % (isa, used))


def test_algorithm_tables():
    """Algorithm names are listed in table order (new ones may be added)."""

    def in_order(got, want):
        got = list(got)
        return all(w in got for w in want) and [g for g in got if g in want] == list(want)

    assert in_order(plait.algorithms("allreduce"), ["one_shot", "two_shot", "ring", "tree", "single_copy"])
    assert in_order(plait.algorithms("reduce_scatter"), ["direct", "ring", "single_copy"])
    assert in_order(plait.algorithms("allgather"), ["direct", "ring", "single_copy"])
    assert list(plait.algorithms("broadcast")) == ["direct", "single_copy"]
    assert list(plait.algorithms("reduce")) == ["direct", "single_copy"]
    assert list(plait.algorithms("alltoall")) == ["direct", "single_copy"]


def _inplace_views_worker(rank, n, store):
    """NCCL-style in place: reduce_scatter into this rank's block of x, allgather from its block
    of out."""
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT, buffer_bytes=SMALL_BUFFER)
    chk = Check(rank)
    with comm:
        for algo in list(plait.algorithms("reduce_scatter")) + ["auto"]:
            for count in (1, 37, 5001):
                x = data(rank, count * n, "int32")
                full = reduce_ref([data(r, count * n, "int32") for r in range(n)], "int32", "sum")
                label = "reduce_scatter %s count=%d into its own block of x" % (algo, count)
                with case(label):
                    got = comm.reduce_scatter(x, x[rank * count : (rank + 1) * count], algorithm=algo)
                chk.eq(label, got, full[rank * count : (rank + 1) * count])
        for algo in list(plait.algorithms("allgather")) + ["auto"]:
            for count in (1, 37, 5001):
                out = np.zeros(count * n, np.float16)
                out[rank * count : (rank + 1) * count] = data(rank, count, "float16")
                label = "allgather %s count=%d from its own block of out" % (algo, count)
                with case(label):
                    got = comm.allgather(out[rank * count : (rank + 1) * count], out, algorithm=algo)
                chk.eq(label, got, np.concatenate([data(r, count, "float16") for r in range(n)]))
        # In place across several chunks: single_copy's peers read this rank's input while it
        # overwrites the chunks they have finished with (its scratch chunk is 1 MiB / (n-1)).
        count = 700_001
        want = reduce_ref([data(r, count, "int32") for r in range(n)], "int32", "sum")
        for algo in list(plait.algorithms("allreduce")) + ["auto"]:
            x = data(rank, count, "int32")
            label = "allreduce %s count=%d in place" % (algo, count)
            with case(label):
                got = comm.allreduce(x, x, algorithm=algo)
            chk.eq(label, got, want, same_on_all_ranks=True)
        for algo in list(plait.algorithms("reduce_scatter")) + ["auto"]:
            per = count // n
            x = data(rank, per * n, "int32")
            full = reduce_ref([data(r, per * n, "int32") for r in range(n)], "int32", "sum")
            label = "reduce_scatter %s count=%d in place" % (algo, per)
            with case(label):
                got = comm.reduce_scatter(x, x[rank * per : (rank + 1) * per], algorithm=algo)
            chk.eq(label, got, full[rank * per : (rank + 1) * per])
        for algo in list(plait.algorithms("reduce")) + ["auto"]:
            x = data(rank, count, "int32")
            root = n - 1
            label = "reduce %s count=%d root=%d, in place at the root" % (algo, count, root)
            with case(label):
                got = comm.reduce(x, root, out=x if rank == root else None, algorithm=algo)
            if rank == root:
                chk.eq(label, got, want)
            else:
                chk.true(label + ": non-root got a result", got is None)
                chk.eq(label + " (input changed)", x, data(rank, count, "int32"))
    return {"digests": chk.done()}


@pytest.mark.parametrize("n", (2, 3), ids=lambda n: "n%d" % n)
def test_inplace_views(n):
    run_ranks(_inplace_views_worker, n, timeout=RUN_TIMEOUT)


def _ml_dtypes_worker(rank, n, store):
    import ml_dtypes

    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT, buffer_bytes=SMALL_BUFFER)
    chk = Check(rank)
    with comm:
        for op in ("sum", "max", "avg"):
            for algo in list(plait.algorithms("allreduce")) + ["auto"]:
                x = data(rank, 5001, "bfloat16", op).view(ml_dtypes.bfloat16)
                label = "ml_dtypes.bfloat16 allreduce %s %s" % (op, algo)
                with case(label):
                    got = comm.allreduce(x, op=op, algorithm=algo)
                chk.true(label + ": result dtype %s" % got.dtype, got.dtype == x.dtype)
                want = reduce_ref([data(r, 5001, "bfloat16", op) for r in range(n)], "bfloat16", op)
                chk.eq(label, got.view(np.uint16), want, same_on_all_ranks=True)
        x = data(rank, 37, "bfloat16").view(ml_dtypes.bfloat16)
        with case("ml_dtypes.bfloat16 allgather/broadcast"):
            g = comm.allgather(x)
            b = comm.broadcast(x.copy(), root=n - 1)
        chk.eq(
            "ml_dtypes allgather", g.view(np.uint16), np.stack([data(r, 37, "bfloat16") for r in range(n)])
        )
        chk.eq("ml_dtypes broadcast", b.view(np.uint16), data(n - 1, 37, "bfloat16"))
    return {"digests": chk.done()}


def test_ml_dtypes_bfloat16():
    pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    _same_on_all_ranks(run_ranks(_ml_dtypes_worker, 3, timeout=RUN_TIMEOUT))


def _module_functions_worker(rank, n, store):
    """The module-level functions act on the communicator plait.init made the default."""
    plait.init(rank, n, store=store, timeout=CALL_TIMEOUT, buffer_bytes=SMALL_BUFFER)
    chk = Check(rank)
    x = data(rank, 37, "int64")
    chk.eq(
        "plait.allreduce",
        plait.allreduce(x, op="max"),
        reduce_ref([data(r, 37, "int64") for r in range(n)], "int64", "max"),
    )
    chk.eq("plait.allgather", plait.allgather(x), np.stack([data(r, 37, "int64") for r in range(n)]))
    chk.eq(
        "plait.reduce_scatter",
        plait.reduce_scatter(data(rank, 3 * n, "uint8")),
        reduce_ref([data(r, 3 * n, "uint8") for r in range(n)], "uint8", "sum")[rank * 3 : (rank + 1) * 3],
    )
    chk.eq("plait.broadcast", plait.broadcast(x.copy(), root=n - 1), data(n - 1, 37, "int64"))
    got = plait.reduce(x, root=0)
    if rank == 0:
        chk.eq("plait.reduce", got, reduce_ref([data(r, 37, "int64") for r in range(n)], "int64", "sum"))
    chk.eq(
        "plait.alltoall",
        np.asarray(plait.alltoall(np.full(n, rank, np.int32))).reshape(-1),
        np.arange(n, dtype=np.int32),
    )
    chk.true("plait.barrier", plait.barrier() is None)
    plait.finalize()
    return {"digests": chk.done()}


def test_module_functions():
    run_ranks(_module_functions_worker, 3, timeout=RUN_TIMEOUT)


def _env_worker(rank, n, store):
    """plait.init() with no arguments: RANK, WORLD_SIZE, PLAIT_STORE, PLAIT_ALGO,
    PLAIT_BUFFER_BYTES and PLAIT_TIMEOUT come from the environment."""
    comm = plait.init()
    chk = Check(rank)
    with comm:
        chk.true("rank/size from the environment", (comm.rank, comm.size) == (rank, n))
        for dt, op in (("float32", "sum"), ("int8", "prod"), ("bfloat16", "avg"), ("bool", "min")):
            for count in COUNTS:
                label = "PLAIT_ALGO allreduce %s %s count=%d" % (dt, op, count)
                with case(label):
                    got = comm.allreduce(data(rank, count, dt, op), op=op, **dtype_kw(dt))
                chk.eq(
                    label,
                    got,
                    reduce_ref([data(r, count, dt, op) for r in range(n)], dt, op),
                    same_on_all_ranks=True,
                )
    return {"digests": chk.done()}


@pytest.mark.parametrize("algo", plait.algorithms("allreduce"))
def test_env_knobs(algo):
    env = {"PLAIT_ALGO": algo, "PLAIT_BUFFER_BYTES": "4096", "PLAIT_TIMEOUT": "30"}
    _same_on_all_ranks(run_ranks(_env_worker, 3, timeout=RUN_TIMEOUT, env=env))


def _gil_worker(rank, n, store):
    """A small call that has to wait for a late peer lets this rank's other Python threads run
    (plait keeps the GIL only while it spins), and so does a large call. Measured as the rate a
    counting thread reaches during the call against its rate while the main thread sleeps."""
    import threading
    import time

    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    def rate_during(fn):
        before, t0 = ticks[0], time.perf_counter()
        fn()
        return (ticks[0] - before) / (time.perf_counter() - t0)

    with comm:
        res = {}
        t = threading.Thread(target=count) if rank == 0 else None
        if t:
            t.start()
        for label, count_ in (("small", 2), ("large", 1 << 20)):
            x = np.ones(count_, np.float32)
            comm.barrier()
            if rank == 1:
                time.sleep(0.6)  # rank 0 waits ~0.6 s inside its call
                comm.allreduce(x)
                continue
            res[label + " sleeping"] = rate_during(lambda: time.sleep(0.3))
            res[label] = rate_during(lambda: comm.allreduce(x))  # noqa: B023 - called at once
        if t:
            stop.set()
            t.join()
        return res


def test_waiting_calls_release_the_gil():
    res = run_ranks(_gil_worker, 2, timeout=RUN_TIMEOUT)[0]
    # Had the call kept the GIL, the thread would run only in the ~5 ms before the call takes it
    # (Python's switch interval): under 2% of its rate while the main thread sleeps.
    for label in ("small", "large"):
        assert res[label] > 0.25 * res[label + " sleeping"], res
