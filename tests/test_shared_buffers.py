"""plait-owned shared buffers: plait.empty / plait.zeros, plait.is_shared, and the single_copy
algorithms' direct path through peers' mapped memory (comm.mapped_bytes counts it).

Data is integer-valued and comes from test_collectives' closed formulas, so every result compares
bit for bit with numpy. Each test is one run_ranks launch (hard timeout) whose ranks loop over
their cases and collect wrong results instead of stopping at the first, so that they stay in step.
Wherever single copy is unavailable on this machine (ptrace scope, seccomp), the tests that need it
skip saying why.
"""

import gc
import os
import re
import signal
import threading
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks
from test_collectives import Check, case, data, dtype_kw, reduce_ref, storage, wait_rotated

CALL_TIMEOUT = 30
RUN_TIMEOUT = 180
BIG = 300_001  # elements: above the 256 KiB single-copy chunk in every dtype
# Out-of-place allreduce outputs of 8 MiB and more are written with non-temporal stores.
HUGE = (("float32", 2_200_001, "sum"), ("bfloat16", 4_400_003, "max"))
SMALL = (0, 1, 37)
DTS = ("int32", "float32", "float64", "int8", "uint8", "bfloat16")
OPS4 = ("sum", "max", "min", "prod")
COLLS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall")
PEER_READ = ("single_copy", "shared_or_staged")  # the rows that map peers' shared buffers
LOST_WITHIN_S = 2.0  # the PeerLostError contract (test_faults.py)


# ---------------------------------------------------------------- buffers


def shared(shape, dt):
    """A plait-owned shared array holding dt (raw bfloat16 lives in a float16 region as uint16)."""
    if dt == "bfloat16":
        return plait.empty(shape, dtype="float16").view(np.uint16)
    return plait.empty(shape, dtype=dt)


def private(shape, dt):
    return np.empty(shape, storage(dt))


def alloc(shape, dt, is_shared):
    return shared(shape, dt) if is_shared else private(shape, dt)


def filled(a, dt, is_shared=True):
    out = alloc(a.shape, dt, is_shared)
    out[...] = a
    return out


def skip_reason(comm):
    """None when single copy works here, else why not (and the communicator is closed)."""
    if comm.single_copy:
        return None
    why = comm.single_copy_unavailable or "(no reason given)"
    comm.finalize()
    return "single copy unavailable here: " + why


def skip_if_told(results):
    for res in results:
        if isinstance(res, dict) and res.get("skip"):
            pytest.skip(res["skip"])


def memfd_maps():
    """(start, end, perms, path) of this process's memfd mappings."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and "memfd:" in parts[5]:
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                found.append((lo, hi, parts[1], parts[5].strip()))
    return found


def address(a):
    return a.__array_interface__["data"][0]


def shm_entries():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


_OWNER = re.compile(r"plait-(\d+)-")


def ours(names, pids):
    """The plait entries of `names` made by one of `pids` (plait names what it creates
    plait-<pid>-...; other jobs on this machine may come and go in /dev/shm meanwhile)."""
    return {name for name in names if (m := _OWNER.match(name)) and int(m.group(1)) in pids}


# ---------------------------------------------------------------- one collective, checked


def run_coll(comm, chk, coll, dt, count, *, op="sum", root=0, mode="out", place=None, label=""):
    """Runs `coll` with algorithm="single_copy" on data(...) of `count` elements (per block for
    reduce_scatter / allgather / alltoall) and checks the result exactly. mode: "out" (a separate
    output), "in-place", or "none" (out=None: plait allocates a private output). place(io) says
    whether this rank's input ("in") / output ("out") is plait.empty memory (default: both)."""
    n, rank = comm.size, comm.rank
    place = place or (lambda io: True)
    kw = dict(algorithm="single_copy", **dtype_kw(dt))
    label = "%s %s %s count=%d %s%s" % (coll, dt, op, count, mode, label)
    with case(label):
        if coll == "allreduce":
            x = filled(data(rank, count, dt, op), dt, place("in"))
            x0 = x.copy()
            want = reduce_ref([data(r, count, dt, op) for r in range(n)], dt, op)
            out = {
                "out": lambda: alloc(count, dt, place("out")),
                "in-place": lambda: x,
                "none": lambda: None,
            }[mode]()
            got = comm.allreduce(x, out, op=op, **kw)
        elif coll == "reduce_scatter":
            x = filled(data(rank, count * n, dt, op), dt, place("in"))
            x0 = x.copy()
            want = reduce_ref([data(r, count * n, dt, op) for r in range(n)], dt, op)
            want = want[rank * count : (rank + 1) * count]
            out = {
                "out": lambda: alloc(count, dt, place("out")),
                "in-place": lambda: x[rank * count : (rank + 1) * count],
                "none": lambda: None,
            }[mode]()
            got = comm.reduce_scatter(x, out, op=op, **kw)
        elif coll == "allgather":
            want = np.concatenate([data(r, count, dt, salt=3) for r in range(n)])
            if mode == "in-place":
                out = alloc(count * n, dt, place("out"))
                out[...] = 0
                x = out[rank * count : (rank + 1) * count]
                x[...] = data(rank, count, dt, salt=3)
            else:
                x = filled(data(rank, count, dt, salt=3), dt, place("in"))
                out = alloc(count * n, dt, place("out")) if mode == "out" else None
            x0 = x.copy()
            got = comm.allgather(x, out, **kw)
            got = np.asarray(got).reshape(-1)
        elif coll == "broadcast":
            x = filled(data(rank, count, dt, salt=root + 7), dt, place("in"))
            x0 = x.copy()
            want = data(root, count, dt, salt=root + 7)
            out = {
                "out": lambda: alloc(count, dt, place("out")),
                "in-place": lambda: None,
                "none": lambda: None,
            }[mode]()
            got = comm.broadcast(x, root, out=out, **kw)
            if out is None:
                out = x
        elif coll == "reduce":
            x = filled(data(rank, count, dt, op), dt, place("in"))
            x0 = x.copy()
            want = reduce_ref([data(r, count, dt, op) for r in range(n)], dt, op)
            out = None
            if rank == root:
                out = {
                    "out": lambda: alloc(count, dt, place("out")),
                    "in-place": lambda: x,
                    "none": lambda: None,
                }[mode]()
            got = comm.reduce(x, root, out=out, op=op, **kw)
        elif coll == "alltoall":
            # block j of rank r's input holds data(r * n + j); it must land in block r of rank j.
            x = filled(
                np.concatenate([data(rank * n + j, count, dt, salt=5) for j in range(n)]), dt, place("in")
            )
            x0 = x.copy()
            want = np.concatenate([data(j * n + rank, count, dt, salt=5) for j in range(n)])
            out = {
                "out": lambda: alloc(count * n, dt, place("out")),
                "in-place": lambda: x,
                "none": lambda: None,
            }[mode]()
            got = comm.alltoall(x, out, **kw)
            got = np.asarray(got).reshape(-1)
        else:
            raise ValueError(coll)
    if coll == "reduce" and rank != root:
        chk.true(label + ": non-root got %r, want None" % type(got), got is None)
    else:
        if out is not None and coll not in ("allgather", "alltoall"):
            chk.true(label + ": did not return out", got is out)
        chk.eq(label, got, want)
    if out is None or not np.shares_memory(x, out):
        chk.eq(label + " (input changed)", x, x0)


def _whole_call(comm, chk, coll, algo, dt, count, label, in_place):
    """One call of `coll` on a shared input of count*n elements with shared outputs, checked
    against the closed form. in_place: allreduce in place and broadcast from the last rank into x
    (else out of place, from rank 0)."""
    rank, n = comm.rank, comm.size
    x = filled(data(rank, count * n, dt), dt)
    kw = dict(algorithm=algo, **dtype_kw(dt))
    full = reduce_ref([data(r, count * n, dt) for r in range(n)], dt, "sum")
    with case(label):
        if coll == "allreduce":
            got, want = comm.allreduce(x, x if in_place else shared(count * n, dt), **kw), full
        elif coll == "reduce_scatter":
            got = comm.reduce_scatter(x, shared(count, dt), **kw)
            want = full[rank * count : (rank + 1) * count]
        elif coll == "allgather":
            got = comm.allgather(x, shared(count * n * n, dt), **kw)
            want = np.concatenate([data(r, count * n, dt) for r in range(n)])
        elif coll == "broadcast":
            root = n - 1 if in_place else 0
            got = comm.broadcast(x, root, out=None if in_place else shared(count * n, dt), **kw)
            want = data(root, count * n, dt)
        elif coll == "reduce":
            got = comm.reduce(x, 0, out=shared(count * n, dt) if rank == 0 else None, **kw)
            want = full if rank == 0 else None
        else:
            got = comm.alltoall(x, shared(count * n, dt), **kw)
            want = np.concatenate(
                [data(j, count * n, dt)[rank * count : (rank + 1) * count] for j in range(n)]
            )
    if want is None:
        chk.true(label + ": non-root got a result", got is None)
    else:
        chk.eq(label, np.asarray(got).reshape(-1), want)


# ---------------------------------------------------------------- 1: exact, all shared


def _exact_worker(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
    why = skip_reason(comm)
    if why:
        return {"skip": why}
    chk = Check(rank)
    mapped, big = {}, {}
    with comm:
        roots = sorted({0, n - 1})
        for coll in COLLS:
            m0 = comm.mapped_bytes
            for k, dt in enumerate(DTS):
                cases = []
                for ci, count in enumerate(SMALL + (BIG,)):
                    modes = (
                        ("out", "in-place")
                        if count != BIG or coll == "allreduce"
                        else (("out", "in-place")[k % 2],)
                    )
                    for mi, mode in enumerate(modes):
                        ops = (
                            OPS4
                            if coll in ("allreduce", "reduce_scatter", "reduce") and count != BIG
                            else (OPS4[(k + ci + mi) % 4],)
                        )
                        for op in ops:
                            for root in roots if coll in ("broadcast", "reduce") else (0,):
                                cases.append((count, mode, op, root))
                for count, mode, op, root in cases:
                    before = comm.mapped_bytes
                    run_coll(
                        comm,
                        chk,
                        coll,
                        dt,
                        count,
                        op=op,
                        root=root,
                        mode=mode,
                        label=" root=%d" % root if coll in ("broadcast", "reduce") else "",
                    )
                    if coll == "allreduce" and count == BIG:
                        # It reduces part `rank` (count // n elements or more) from n-1 peers.
                        esize = storage(dt).itemsize
                        big["%s %s" % (dt, mode)] = (
                            comm.mapped_bytes - before,
                            (n - 1) * (count // n) * esize,
                            2 * n * count * esize,
                        )
            if coll == "allreduce":
                for dt, count, op in HUGE:  # the streaming-store path (out of place, >= 8 MiB)
                    before = comm.mapped_bytes
                    run_coll(comm, chk, coll, dt, count, op=op, mode="out")
                    esize = storage(dt).itemsize
                    big["%s %s huge" % (dt, op)] = (
                        comm.mapped_bytes - before,
                        (n - 1) * (count // n) * esize,
                        2 * n * count * esize,
                    )
            mapped[coll] = comm.mapped_bytes - m0

        # auto: 2 ranks (not oversubscribed) take single_copy above ~16 KiB (allreduce,
        # reduce_scatter) / ~8 KiB per rank (allgather), and not for a few hundred bytes.
        auto = {}
        if n == 2 and n <= (os.cpu_count() or 1):
            for coll, count, big_enough in (
                ("allreduce", 64, False),
                ("allreduce", 16384, True),
                ("reduce_scatter", 32, False),
                ("reduce_scatter", 8192, True),
                ("allgather", 32, False),
                ("allgather", 8192, True),
            ):
                x = filled(data(rank, count, "float32"), "float32")
                before = comm.mapped_bytes
                label = "auto %s float32 count=%d" % (coll, count)
                with case(label):
                    if coll == "allreduce":
                        got = comm.allreduce(x, shared(count, "float32"))
                        want = reduce_ref([data(r, count, "float32") for r in range(n)], "float32", "sum")
                    elif coll == "reduce_scatter":
                        got = comm.reduce_scatter(x, shared(count // n, "float32"))
                        want = reduce_ref([data(r, count, "float32") for r in range(n)], "float32", "sum")
                        want = want[rank * (count // n) : (rank + 1) * (count // n)]
                    else:
                        got = comm.allgather(x, shared(count * n, "float32"))
                        want = np.concatenate([data(r, count, "float32") for r in range(n)])
                chk.eq(label, got, want)
                auto[label] = (comm.mapped_bytes - before, big_enough)
        return {"digests": chk.done(), "mapped": mapped, "big": big, "auto": auto, "total": comm.mapped_bytes}


@pytest.mark.slow
@pytest.mark.parametrize("n", (1, 2, 3, 4), ids=lambda n: "n%d" % n)
def test_exact_all_shared(n):
    results = run_ranks(_exact_worker, n, timeout=RUN_TIMEOUT)
    skip_if_told(results)
    if n == 1:
        for res in results:
            assert res["total"] == 0, "n=1 has no peers, yet mapped_bytes = %d" % res["total"]
        return
    for coll in COLLS:
        moved = [res["mapped"][coll] for res in results]
        assert sum(moved) > 0, (
            "%s with every buffer shared: mapped_bytes did not grow on any rank (per rank %s)" % (coll, moved)
        )
    for rank, res in enumerate(results):
        assert res["mapped"]["allreduce"] > 0, (rank, res["mapped"])
        for label, (got, lo, hi) in res["big"].items():
            assert lo <= got <= hi, "rank %d allreduce %s: mapped_bytes grew by %d, want %d..%d" % (
                rank,
                label,
                got,
                lo,
                hi,
            )
        for label, (got, big_enough) in res["auto"].items():
            if big_enough:
                assert got > 0, (
                    "rank %d %s: auto did not take the mapped single_copy path "
                    "(mapped_bytes +%d)" % (rank, label, got)
                )
            else:
                assert got == 0, "rank %d %s: auto took single_copy for a small call (mapped_bytes +%d)" % (
                    rank,
                    label,
                    got,
                )


# ---------------------------------------------------------------- 2, 3: mixed placement, views


def _placements(n):
    return {
        "all private": lambda r, io: False,
        "rank 0 shared, others private": lambda r, io: r == 0,
        "inputs shared, outputs private": lambda r, io: io == "in",
        "outputs shared, inputs private": lambda r, io: io == "out",
        "checkerboard": lambda r, io: (r + (io == "out")) % 2 == 0,
        "last rank private": lambda r, io: r != n - 1,
    }


def _view_cases(comm, chk):
    """Inputs and outputs that are views into bigger shared arrays: at an element offset, ending
    exactly at the region's end, a row of a 2-D array, one byte past an element boundary. The
    elements of the bigger arrays around the views must be left alone."""
    n, rank = comm.size, comm.rank
    sentinel = {"int32": -123456789, "float64": -0.5, "bfloat16": 0xBEEF, "uint8": 0xA5, "float32": -7.25}

    def in_view(base_len, at, values, dt, kind):
        if kind == "unaligned":
            raw = plait.empty(values.nbytes + storage(dt).itemsize, dtype="uint8")
            raw[...] = 0x5A
            v = raw[1 : 1 + values.nbytes].view(storage(dt))
            v[...] = values
            return v, raw
        if kind == "row":
            base = shared((3, values.size), dt)
            base[...] = sentinel[dt]
            base[1] = values
            return base[1], base
        base = shared(base_len, dt)
        base[...] = sentinel[dt]
        at = base_len - values.size if at is None else at
        v = base[at : at + values.size]
        v[...] = values
        return v, base

    def guard_ok(base, view):
        """Everything of base outside view still holds what it held before the call."""
        b = base.view(np.uint8).reshape(-1)
        lo = address(view) - address(base)
        mask = np.ones(b.size, bool)
        mask[lo : lo + view.nbytes] = False
        return b[mask]

    kinds = ("offset", "end", "row", "unaligned")
    pairs = [(a, b) for a in kinds for b in kinds]
    cases = [
        (c, cnt, ("int32", "float64", "bfloat16", "uint8", "float32")[k % 5], pairs[k % len(pairs)])
        for k, (c, cnt) in enumerate((c, cnt) for c in COLLS for cnt in (1, 37, BIG))
    ]
    # Out-of-place allreduce of >= 8 MiB streams its output: views at odd offsets there too.
    cases += [
        ("allreduce", 2_200_001, "float32", ("offset", "unaligned")),
        ("allreduce", 2_200_001, "int32", ("unaligned", "end")),
    ]
    for k, (coll, count, dt, (kind_in, kind_out)) in enumerate(cases):
        if kind_in == "unaligned" or kind_out == "unaligned":
            dt = "int32" if dt == "uint8" else dt  # a byte offset means nothing for 1-byte types
        op = OPS4[k % 4]
        label = "views %s %s %s count=%d in=%s out=%s" % (coll, dt, op, count, kind_in, kind_out)
        blocks = n if coll in ("reduce_scatter", "alltoall") else 1
        if coll == "alltoall":
            xv = np.concatenate([data(rank * n + j, count, dt, salt=5) for j in range(n)])
            want = np.concatenate([data(j * n + rank, count, dt, salt=5) for j in range(n)])
        elif coll == "allgather":
            xv = data(rank, count, dt, salt=3)
            want = np.concatenate([data(r, count, dt, salt=3) for r in range(n)])
        elif coll == "broadcast":
            xv = data(rank, count, dt, salt=9)
            want = data(n - 1, count, dt, salt=9)
        else:
            xv = data(rank, count * blocks, dt, op)
            want = reduce_ref([data(r, count * blocks, dt, op) for r in range(n)], dt, op)
            if coll == "reduce_scatter":
                want = want[rank * count : (rank + 1) * count]
        out_len = want.size
        x, xbase = in_view(xv.size + 29, 5, xv, dt, kind_in)
        o, obase = in_view(
            out_len + 17, 3 if kind_out == "offset" else None, np.zeros(out_len, storage(dt)), dt, kind_out
        )
        checks = [plait.is_shared(x), plait.is_shared(o)]
        chk.true(label + ": is_shared(view) is %s" % checks, all(checks))
        xg, og = guard_ok(xbase, x).copy(), guard_ok(obase, o).copy()
        x0 = x.copy()
        kw = dict(algorithm="single_copy", **dtype_kw(dt))
        with case(label):
            if coll == "allreduce":
                got = comm.allreduce(x, o, op=op, **kw)
            elif coll == "reduce_scatter":
                got = comm.reduce_scatter(x, o, op=op, **kw)
            elif coll == "allgather":
                got = comm.allgather(x, o, **kw)
            elif coll == "broadcast":
                got = comm.broadcast(x, n - 1, out=o, **kw)
            elif coll == "reduce":
                got = comm.reduce(x, n - 1, out=o if rank == n - 1 else None, op=op, **kw)
                if rank != n - 1:
                    got = None
            else:
                got = comm.alltoall(x, o, **kw)
        if got is not None:
            chk.eq(label, np.asarray(got).reshape(-1), want)
        chk.eq(label + " (input view changed)", x, x0)
        chk.eq(label + " (input's surroundings changed)", guard_ok(xbase, x), xg)
        chk.eq(label + " (output's surroundings changed)", guard_ok(obase, o), og)


def _mixed_worker(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
    why = skip_reason(comm)
    if why:
        return {"skip": why}
    chk = Check(rank)
    mapped = {}
    with comm:
        chk.true("is_shared(np.empty(8)) is True", not plait.is_shared(np.empty(8)))
        for p, (pname, where) in enumerate(_placements(n).items()):
            place = lambda io: where(rank, io)  # noqa: E731,B023 - used within this iteration
            m0 = comm.mapped_bytes
            for k, coll in enumerate(COLLS):
                for count in (37, BIG):
                    dt = ("int32", "float64", "bfloat16", "uint8")[(p + k) % 4]
                    op = OPS4[(p + k + (count == BIG)) % 4]
                    root = (p + k) % n
                    modes = ("out", "in-place", "none") if count == BIG else ("out",)
                    for mode in modes:
                        run_coll(
                            comm,
                            chk,
                            coll,
                            dt,
                            count,
                            op=op,
                            root=root,
                            mode=mode,
                            place=place,
                            label=" root=%d [%s]" % (root, pname),
                        )
            dt, count, op = HUGE[p % len(HUGE)]
            run_coll(comm, chk, "allreduce", dt, count, op=op, place=place, label=" [%s]" % pname)
            mapped[pname] = comm.mapped_bytes - m0

        m0 = comm.mapped_bytes
        _view_cases(comm, chk)
        mapped["views"] = comm.mapped_bytes - m0

        # The other algorithms take shared buffers like any others.
        for coll in COLLS:
            for k, algo in enumerate(a for a in plait.algorithms(coll) if a not in PEER_READ):
                dt = ("float32", "int8", "bfloat16")[k % 3]
                for count in (37, 20_001):
                    label = "%s %s on shared buffers %s count=%d" % (coll, algo, dt, count)
                    _whole_call(comm, chk, coll, algo, dt, count, label, in_place=False)
        return {"digests": chk.done(), "mapped": mapped}


@pytest.mark.slow
@pytest.mark.parametrize("n", (2, 3), ids=lambda n: "n%d" % n)
def test_mixed_placement_and_views(n):
    results = run_ranks(_mixed_worker, n, timeout=RUN_TIMEOUT)
    skip_if_told(results)
    per = {name: [res["mapped"][name] for res in results] for name in results[0]["mapped"]}
    assert per["all private"] == [0] * n, (
        "private buffers only, yet mapped_bytes grew: per rank %s" % per["all private"]
    )
    # Rank 0 only ever touches its peers' buffers, which are all private here.
    got = per["rank 0 shared, others private"]
    assert got[0] == 0, "rank 0 moved %d bytes through mappings of private peers' memory" % got[0]
    assert sum(got[1:]) > 0, "no rank read rank 0's shared buffers through a mapping: %s" % got
    for name in (
        "inputs shared, outputs private",
        "outputs shared, inputs private",
        "checkerboard",
        "last rank private",
        "views",
    ):
        assert sum(per[name]) > 0, "%s: mapped_bytes did not grow on any rank: %s" % (name, per[name])


# ---------------------------------------------------------------- 4: churn

CHURN = 40


def _churn_worker(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
    why = skip_reason(comm)
    if why:
        return {"skip": why}
    chk = Check(rank)
    with comm:
        gc.collect()
        start = plait._C.shared_region_count()
        most, kept = start, []
        m0 = comm.mapped_bytes
        for it in range(CHURN):
            # Same size on even iterations (a freed region's fd and address come back for the
            # next one), different sizes on odd ones; fresh values every time.
            count = 20_011 if it % 2 == 0 else 20_011 + 4099 * (it % 7)
            dt = ("int32", "float32", "int8", "bfloat16")[(it // 2) % 4]
            if rank == 1 and it % 3 == 0:
                kept.append(shared(1000 + it, "uint8"))  # shifts this rank's fds and addresses
            if rank == 1 and len(kept) > 3:
                kept.pop(0)
            x = filled(data(rank, count, dt, salt=it), dt)
            out = shared(count, dt)
            label = "churn %d allreduce %s count=%d" % (it, dt, count)
            with case(label):
                comm.allreduce(x, out, algorithm="single_copy", **dtype_kw(dt))
            chk.eq(label, out, reduce_ref([data(r, count, dt, salt=it) for r in range(n)], dt, "sum"))
            g = shared(count * n, dt)
            label = "churn %d allgather %s count=%d" % (it, dt, count)
            with case(label):
                comm.allgather(out if it % 4 == 1 else x, g, algorithm="single_copy", **dtype_kw(dt))
            want = (
                np.concatenate([data(r, count, dt, salt=it) for r in range(n)])
                if it % 4 != 1
                else np.tile(out, n)
            )
            chk.eq(label, g, want)
            label = "churn %d broadcast %s in place" % (it, dt)
            with case(label):
                comm.broadcast(x, root=it % n, algorithm="single_copy", **dtype_kw(dt))
            chk.eq(label, x, data(it % n, count, dt, salt=it))
            most = max(most, plait._C.shared_region_count())
            del x, out, g
        moved = comm.mapped_bytes - m0
        kept.clear()
        comm.barrier()
        gc.collect()
        end = plait._C.shared_region_count()
        mappings = len(memfd_maps())
    return {
        "digests": chk.done(),
        "start": start,
        "end": end,
        "most": most,
        "moved": moved,
        "mappings": mappings,
    }


def test_churn_fresh_buffers_every_call():
    n = 3
    results = run_ranks(_churn_worker, n, timeout=RUN_TIMEOUT)
    skip_if_told(results)
    for rank, res in enumerate(results):
        assert res["end"] == res["start"], (
            "rank %d: shared_region_count() %d before the churn, "
            "%d after gc.collect()" % (rank, res["start"], res["end"])
        )
        assert res["most"] - res["start"] <= 8, (
            "rank %d: up to %d live regions during the "
            "churn (never more than 7 arrays alive at once)" % (rank, res["most"] - res["start"])
        )
        assert res["moved"] > 0, "rank %d: the churn never took the mapped path" % rank
        # Peers' regions may be cached, but not every one ever seen: 40 iterations x 3 arrays x
        # 2 peers of freed memory would be 240 mappings.
        assert res["mappings"] <= 160, "rank %d: %d memfd mappings left after the churn" % (
            rank,
            res["mappings"],
        )


# ---------------------------------------------------------------- API, lifetime, no /dev/shm


def _api_worker(rank, n, store):
    wrong = []

    def true(label, cond):
        if not cond:
            wrong.append(label)

    gc.collect()
    start = plait._C.shared_region_count()
    shm_before = shm_entries()
    keep = []
    for dt in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"):
        for shape in (5, (3, 4), (2, 3, 5), 1 << 16):
            for make in (plait.empty, plait.zeros):
                a = make(shape, dtype=dt)
                want_shape = (shape,) if isinstance(shape, int) else shape
                label = "%s(%r, %s)" % (make.__name__, shape, dt)
                true(label + ": type %r" % type(a), isinstance(a, np.ndarray))
                true(label + ": dtype %s" % a.dtype, a.dtype == np.dtype(dt))
                true(label + ": shape %s" % (a.shape,), a.shape == want_shape)
                true(label + ": not C-contiguous", a.flags.c_contiguous)
                true(label + ": not writeable", a.flags.writeable)
                true(label + ": not aligned", a.flags.aligned)
                true(label + ": is_shared False", plait.is_shared(a))
                if make is plait.zeros:
                    true(label + ": not zero-filled", not a.view(np.uint8).any())
                a.reshape(-1)[-1] = 1
                keep.append(a)
    true("default dtype float32", plait.empty(4).dtype == np.float32 and plait.zeros(4).dtype == np.float32)
    true(
        "dtype np.float64 / np.dtype('int8')",
        plait.empty(3, dtype=np.float64).dtype == np.float64
        and plait.zeros(3, dtype=np.dtype("int8")).dtype == np.int8,
    )
    try:
        b = plait.empty(7, dtype="bfloat16")
    except (plait.InvalidArgument, TypeError, ValueError):
        pass  # numpy has no bfloat16; declining it is fine
    else:
        true("empty(7, 'bfloat16'): itemsize %d" % b.dtype.itemsize, b.dtype.itemsize == 2)
        true("empty(7, 'bfloat16'): is_shared False", plait.is_shared(b))
        del b  # (numpy knows bfloat16 once ml_dtypes is imported, as other test files do)
    true("live regions did not grow", plait._C.shared_region_count() > start)

    # is_shared: views and slices of shared memory are shared; private memory is not.
    x = plait.zeros((64, 64), dtype="int32")
    views = {
        "x[1:]": x[1:],
        "x[5]": x[5],
        "x[:, 3:7]": x[:, 3:7],
        "x[::2]": x[::2],
        "x.T": x.T,
        "x.reshape(-1)[100:200]": x.reshape(-1)[100:200],
        "x.view(uint8)[1:]": x.view(np.uint8)[1:],
        "x[-1:]": x[-1:],
    }
    for name, v in views.items():
        true("is_shared(%s) is False" % name, plait.is_shared(v))
    for name, v in {
        "np.zeros": np.zeros(64),
        "x.copy()": x.copy(),
        "np.empty_like(x)": np.empty_like(x),
        "np.arange": np.arange(10),
    }.items():
        true("is_shared(%s) is True" % name, not plait.is_shared(v))

    # memfd, MAP_SHARED: the array lies in a shared mapping of a memfd.
    maps = memfd_maps()
    for a in (x, keep[0], keep[-1]):
        hit = [m for m in maps if m[0] <= address(a) < m[1]]
        true("array at %#x is in no memfd mapping" % address(a), bool(hit))
        true("array at %#x: mapping %s is not MAP_SHARED" % (address(a), hit), not hit or hit[0][2][3] == "s")

    # A view keeps its region alive after the base array is gone.
    y = plait.empty(1 << 20, dtype="int64")
    y[...] = np.arange(1 << 20)
    tail = y[-10:]
    del y
    gc.collect()
    true("a view outlives its base: values lost", (tail == np.arange((1 << 20) - 10, 1 << 20)).all())
    true("a view outlives its base: is_shared False", plait.is_shared(tail))

    # zeros over memory that was just freed full of bytes is still zeros.
    for _ in range(3):
        z = plait.empty(1 << 18, dtype="uint8")
        z[...] = 0xFF
        del z
        z = plait.zeros(1 << 18, dtype="uint8")
        true("zeros after a freed 0xFF region is not zero", not z.any())
        del z
    big = plait.zeros(1 << 22, dtype="float64")  # 32 MiB
    true("zeros(4 Mi float64) is not zero", not big.any())
    big[::4096] = 1.0
    true("zeros(4 Mi float64): writes lost", big.sum() == (1 << 22) // 4096)

    shm_after = shm_entries()
    del keep, a, x, views, tail, big
    gc.collect()
    end = plait._C.shared_region_count()
    return {
        "wrong": wrong,
        "start": start,
        "end": end,
        "new_shm": sorted(ours(shm_after - shm_before, {os.getpid()})),
    }


def test_empty_zeros_is_shared_and_lifetime():
    res = run_ranks(_api_worker, 1, timeout=60)[0]
    assert not res["wrong"], "\n".join(res["wrong"])
    assert not res["new_shm"], "plait.empty/zeros created entries in /dev/shm: %s" % res["new_shm"]
    assert res["end"] == res["start"], (
        "shared_region_count() %d at the start, %d after every "
        "array was dropped and gc.collect()" % (res["start"], res["end"])
    )


# ---------------------------------------------------------------- regions inherited over fork


def _inherited_worker(rank, n, store, pre):
    """`pre` was allocated by the parent before the ranks were forked: still shared memory here
    (the same pages as the parent's), but its memfd is named after the parent. Peers must not
    take it for one of this rank's own regions; reading it must still give exact results."""
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
    why = skip_reason(comm)
    if why:
        return {"skip": why}
    chk = Check(rank)
    with comm:
        chk.true("an inherited region is not is_shared", plait.is_shared(pre))
        want = pre.astype(np.int64).astype(np.int32) * n
        for k in range(3):
            out = shared(pre.size, "int32")
            with case("allreduce of an inherited region %d" % k):
                comm.allreduce(pre, out, algorithm="single_copy")
            chk.eq("allreduce of an inherited region %d" % k, out, want)
            g = shared(37 * n, "int32")
            with case("allgather of an inherited region %d" % k):
                comm.allgather(pre[k : k + 37], g, algorithm="single_copy")
            chk.eq("allgather of an inherited region %d" % k, g, np.tile(pre[k : k + 37], n))
        m0 = comm.mapped_bytes
        x = filled(data(rank, BIG, "int32"), "int32")
        with case("allreduce of a region made after the fork"):
            got = comm.allreduce(x, shared(BIG, "int32"), algorithm="single_copy")
        chk.eq(
            "allreduce of a region made after the fork",
            got,
            reduce_ref([data(r, BIG, "int32") for r in range(n)], "int32", "sum"),
        )
        return {"digests": chk.done(), "fresh": comm.mapped_bytes - m0}


def test_region_inherited_over_fork():
    gc.collect()
    start = plait._C.shared_region_count()
    pre = plait.empty(BIG, dtype="int32")
    pre[...] = np.arange(BIG) % 1000 - 500
    try:
        results = run_ranks(_inherited_worker, 3, timeout=RUN_TIMEOUT, args=(pre,))
        skip_if_told(results)
        assert (pre == np.arange(BIG) % 1000 - 500).all(), "the ranks changed the parent's array"
        for rank, res in enumerate(results):
            assert res["fresh"] > 0, "rank %d: a region made after the fork was not mapped" % rank
    finally:
        del pre
        gc.collect()
    assert plait._C.shared_region_count() == start


# ---------------------------------------------------------------- 5: a rank killed mid-call


def _die(stamp):
    with open(stamp, "w") as f:
        f.write(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_worker(rank, n, store, victim, stamp):
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
    why = skip_reason(comm)
    if why:
        return {"skip": why}
    pids = {int(p) for p in comm.allgather(np.array([os.getpid()], np.int64)).reshape(-1)}
    listing = shm_entries()
    x = filled(np.ones(BIG, np.float32), "float32")
    out = shared(BIG, "float32")
    g = shared(BIG * n, "float32")
    comm.allreduce(x, out, algorithm="single_copy")
    assert (out == n).all(), "rank %d: first allreduce wrong" % rank
    assert comm.mapped_bytes > 0, "rank %d: the shared buffers were not mapped" % rank
    new = ours(shm_entries() - listing, pids)
    assert not new, "rank %d: shared buffers made /dev/shm entries: %s" % (rank, sorted(new))
    comm.barrier()
    if rank == victim:
        threading.Timer(0.3, _die, args=(stamp,)).start()
    t0, calls = time.monotonic(), 0
    try:
        while time.monotonic() - t0 < 20:
            if calls % 2:
                comm.allgather(x, g, algorithm="single_copy")
            else:
                comm.allreduce(x, out, algorithm="single_copy")
            calls += 1
    except Exception as e:  # noqa: BLE001 - described to the parent
        at = time.monotonic()
        return {
            "exc": type(e).__name__,
            "msg": str(e),
            "at": at,
            "calls": calls,
            "pids": pids,
            "new": sorted(ours(shm_entries() - listing, pids)),
        }
    return {"exc": None, "msg": "no error after %d calls in 20 s" % calls, "pids": pids}


@pytest.mark.parametrize("victim", (0, 2), ids=lambda v: "victim%d" % v)
def test_rank_killed_during_a_shared_call(victim, tmp_path):
    n = 3
    stamp = str(tmp_path / "killed_at")
    before = shm_entries()
    results = run_ranks(_kill_worker, n, timeout=60, args=(victim, stamp), may_die={victim})
    skip_if_told(results)
    assert results[victim] is None, "the victim answered: %s" % (results[victim],)
    killed_at = float(open(stamp).read())
    pids = set()
    for rank, res in enumerate(results):
        if rank == victim:
            continue
        pids |= res["pids"]
        assert res["exc"] == "PeerLostError", "rank %d: %s: %s" % (rank, res["exc"], res["msg"])
        assert re.search(r"\b(?:ranks?|peers?)\b[^.;\n]*?\b%d\b" % victim, res["msg"], re.I), (
            "rank %d: message does not name rank %d: %s" % (rank, victim, res["msg"])
        )
        lag = res["at"] - killed_at
        assert lag < LOST_WITHIN_S, "rank %d raised %.2f s after the kill" % (rank, lag)
        assert not res["new"], "rank %d: new /dev/shm entries after the kill: %s" % (rank, res["new"])
    left = ours(shm_entries() - before, pids)
    assert not left, "left in /dev/shm after the run: %s" % sorted(left)


# ---------------------------------------------------------------- 6: PLAIT_SINGLE_COPY=0


def _off_worker(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
    chk = Check(rank)
    with comm:
        chk.true("single_copy is on despite PLAIT_SINGLE_COPY=0", not comm.single_copy)
        for k, coll in enumerate(COLLS):
            algos = [a for a in plait.algorithms(coll) if a not in PEER_READ] + ["auto"]
            for a, algo in enumerate(algos):
                for count in (37, 20_001) + ((BIG,) if algo == "auto" else ()):
                    dt = ("int32", "float32", "bfloat16", "uint8")[(k + a) % 4]
                    label = "%s %s %s count=%d, PLAIT_SINGLE_COPY=0" % (coll, algo, dt, count)
                    _whole_call(comm, chk, coll, algo, dt, count, label, in_place=True)
        try:
            comm.allreduce(shared(BIG, "float32"), algorithm="single_copy")
            chk.true("algorithm='single_copy' ran with PLAIT_SINGLE_COPY=0", False)
        except plait.InvalidArgument:
            pass
        return {"digests": chk.done(), "mapped": comm.mapped_bytes}


@pytest.mark.parametrize("n", (2, 3), ids=lambda n: "n%d" % n)
def test_single_copy_off_with_shared_buffers(n):
    results = run_ranks(_off_worker, n, timeout=RUN_TIMEOUT, env={"PLAIT_SINGLE_COPY": "0"})
    assert [res["mapped"] for res in results] == [0] * n, "PLAIT_SINGLE_COPY=0, yet mapped_bytes: %s" % [
        res["mapped"] for res in results
    ]


# ---------------------------------------------------------------- 7: async


def _async_worker(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
    why = skip_reason(comm)
    if why:
        return {"skip": why}
    chk = Check(rank)
    with comm:
        m0 = comm.mapped_bytes
        for rnd in range(3):
            count = (37, 20_001, BIG)[rnd]
            sc = dict(algorithm="single_copy")
            a = [filled(data(rank, count, "float32", salt=rnd * 10 + s), "float32") for s in range(3)]
            outs = {
                "allgather": shared(count * n, "int32"),
                "reduce_scatter": shared(count, "float64"),
                "alltoall": shared(count * n, "int8"),
                "reduce": shared(count, "int32") if rank == 0 else None,
                "broadcast": shared(count, "bfloat16"),
            }
            with case("async round %d: issue" % rnd):
                hs = [comm.allreduce(arr, out=arr, async_op=True, **sc) for arr in a]
                # Inputs made inline and dropped: the handles must keep them alive.
                hs.append(
                    comm.allgather(
                        filled(data(rank, count, "int32", salt=rnd), "int32"),
                        outs["allgather"],
                        async_op=True,
                        **sc,
                    )
                )
                hs.append(
                    comm.reduce_scatter(
                        filled(data(rank, count * n, "float64", salt=rnd), "float64"),
                        outs["reduce_scatter"],
                        op="max",
                        async_op=True,
                        **sc,
                    )
                )
                hs.append(
                    comm.alltoall(
                        filled(
                            np.concatenate([data(rank * n + j, count, "int8", salt=rnd) for j in range(n)]),
                            "int8",
                        ),
                        outs["alltoall"],
                        async_op=True,
                        **sc,
                    )
                )
                hs.append(
                    comm.reduce(
                        filled(data(rank, count, "int32", salt=rnd), "int32"),
                        0,
                        out=outs["reduce"],
                        op="min",
                        async_op=True,
                        **sc,
                    )
                )
                hs.append(
                    comm.broadcast(
                        filled(data(rank, count, "bfloat16", salt=rnd), "bfloat16"),
                        n - 1,
                        out=outs["broadcast"],
                        async_op=True,
                        dtype="bfloat16",
                        **sc,
                    )
                )
            gc.collect()
            res = wait_rotated(chk, hs, rank, "async round %d" % rnd)
            for s, arr in enumerate(a):
                want = reduce_ref(
                    [data(r, count, "float32", salt=rnd * 10 + s) for r in range(n)], "float32", "sum"
                )
                chk.eq("async allreduce %d.%d" % (rnd, s), arr, want)
                chk.true("async allreduce %d.%d: wait() did not return out" % (rnd, s), res[s] is arr)
            chk.eq(
                "async allgather %d" % rnd,
                outs["allgather"],
                np.concatenate([data(r, count, "int32", salt=rnd) for r in range(n)]),
            )
            full = reduce_ref([data(r, count * n, "float64", salt=rnd) for r in range(n)], "float64", "max")
            chk.eq(
                "async reduce_scatter %d" % rnd,
                outs["reduce_scatter"],
                full[rank * count : (rank + 1) * count],
            )
            chk.eq(
                "async alltoall %d" % rnd,
                outs["alltoall"],
                np.concatenate([data(j * n + rank, count, "int8", salt=rnd) for j in range(n)]),
            )
            if rank == 0:
                chk.eq(
                    "async reduce %d" % rnd,
                    outs["reduce"],
                    reduce_ref([data(r, count, "int32", salt=rnd) for r in range(n)], "int32", "min"),
                )
            else:
                chk.true("async reduce on a non-root returned %r" % type(res[6]), res[6] is None)
            chk.eq("async broadcast %d" % rnd, outs["broadcast"], data(n - 1, count, "bfloat16", salt=rnd))
        # Many outstanding at once, the same shared output reused in order.
        acc = filled(np.zeros(BIG, np.int64), "int64")
        with case("async chain"):
            hs = [
                comm.allreduce(
                    filled(data(rank, BIG, "int64", salt=k), "int64"),
                    shared(BIG, "int64"),
                    async_op=True,
                    algorithm="single_copy",
                )
                for k in range(6)
            ]
            for h in hs:
                acc += h.wait()
        chk.eq(
            "async chain",
            acc,
            sum(
                reduce_ref([data(r, BIG, "int64", salt=k) for r in range(n)], "int64", "sum")
                for k in range(6)
            ),
        )
        return {"digests": chk.done(), "mapped": comm.mapped_bytes - m0}


@pytest.mark.slow
@pytest.mark.parametrize("n", (2, 3), ids=lambda n: "n%d" % n)
def test_async_with_shared_buffers(n):
    results = run_ranks(_async_worker, n, timeout=RUN_TIMEOUT)
    skip_if_told(results)
    for rank, res in enumerate(results):
        assert res["mapped"] > 0, (
            "rank %d: async single_copy calls with shared buffers never took the mapped path" % rank
        )


# ---------------------------------------------------------------- 8: torch


def _torch_worker(rank, n, store):
    import torch

    comm = plait.init(rank, n, store=store, timeout=CALL_TIMEOUT)
    why = skip_reason(comm)
    if why:
        return {"skip": why}

    def tensor(a, dt):
        """A tensor over a's memory (a bfloat16 one over its float16 region)."""
        if dt == "bfloat16":
            return torch.from_numpy(a.view(np.float16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    chk = Check(rank)
    with comm:
        m0 = comm.mapped_bytes
        for dt, count in (
            ("float32", BIG),
            ("int32", 37),
            ("float64", 20_001),
            ("bfloat16", BIG),
            ("int8", BIG),
        ):
            for algo in ("single_copy", "auto"):
                base = shared(count, dt)
                base[...] = data(rank, count, dt)
                t = tensor(base, dt)
                want = reduce_ref([data(r, count, dt) for r in range(n)], dt, "sum")
                label = "torch %s count=%d %s" % (dt, count, algo)
                with case(label + " in place"):
                    got = comm.allreduce(t, out=t, algorithm=algo)
                chk.true(label + ": did not return out", got is t)
                chk.eq(label + " in place", base, want)
                obase = shared(count, dt)
                o = tensor(obase, dt)
                base[...] = data(rank, count, dt)
                with case(label + " out of place"):
                    comm.allreduce(t, out=o, algorithm=algo)
                chk.eq(label + " out of place", obase, want)
        return {"digests": chk.done(), "mapped": comm.mapped_bytes - m0}


def test_torch_tensors_over_shared_buffers():
    pytest.importorskip("torch", reason="torch is not installed")
    results = run_ranks(_torch_worker, 2, timeout=RUN_TIMEOUT)
    skip_if_told(results)
    for rank, res in enumerate(results):
        assert res["mapped"] > 0, (
            "rank %d: torch tensors over plait.empty memory never took the mapped path" % rank
        )
