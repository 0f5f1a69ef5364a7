"""The common harness: for one collective and size, check every implementation's result, then time
them interleaved.

Why it is shaped this way (shared/notes/machine.md): timings on the 2-core VM drift by up
to 2x between periods, so implementations are compared in one run, trial by trial in rotating
order, and each reported time is the median over trials of the slowest rank's per-iteration mean
(gathered with plait's own allreduce op=max, outside the timed loop). Iterations per trial come
from a warm-up estimate, so a 64 MiB size runs a few iterations and an 8 B size up to 1000.
"""

import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from .collectives import Data, count_wrong, itemsize, storage
from .peers import IN, OUT

MAX_ITERS = 1000


@dataclass
class Config:
    sizes: list
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    placements: tuple = (OUT, IN)
    warmup: int = 2
    iters: int = 0  # fixed iterations per trial; 0: from the time budget
    trials: int = 5
    time_s: float = 0.2  # budget per measurement (all its trials together)
    seed: int = 1


@dataclass
class _Variant:
    impl: object
    placement: str
    x: object
    out: object
    result: object
    recv: object = None
    fn: object = None
    iters: int = 1


def iterations(cfg, estimate_s):
    """Iterations per trial: the budget split over the trials, within [1, MAX_ITERS]."""
    if cfg.iters:
        return cfg.iters
    per_trial = cfg.time_s / max(1, cfg.trials)
    return int(min(MAX_ITERS, max(1, per_trial // max(estimate_s, 1e-9))))


def _load(v, inp, recv, poison):
    """Puts this rank's input where the call reads it; poison first clears the result buffer so a
    call that writes nothing cannot pass on the previous implementation's correct output."""
    if poison:
        recv.view(np.uint8).fill(0)
    if v.x is not None:
        np.copyto(v.x, inp)


def nb_of(count, cfg):
    return count * itemsize(cfg.dtype)


def _complain(comm, coll, cfg, nbytes, v, exp, wrong):
    got = v.result.reshape(-1)
    first = int(np.flatnonzero(got != exp.reshape(-1))[0])
    print(
        f"plait-bench: rank {comm.rank}: WRONG RESULT: {coll.name} {v.impl.name} {cfg.dtype} "
        f"op {cfg.op} {nbytes} B {v.placement}: {wrong} of {got.size} elements differ, first at "
        f"[{first}]: got {got[first]}, expected {exp.reshape(-1)[first]}",
        file=sys.stderr,
        flush=True,
    )


def measure(comm, coll, nbytes, impls, cfg):
    """(records, skips) for one size; records are dicts (see report.RECORD_KEYS)."""
    n, rank = comm.size, comm.rank
    count = coll.count(nbytes, cfg.dtype, n)
    if count == 0:
        return [], []
    data = Data(cfg.dtype, cfg.op if coll.reduces else "sum", n, cfg.seed)
    inp = data.encode(coll.input(data, rank, count))
    exp = coll.expected(data, rank, count, cfg.root)
    exp = None if exp is None else data.encode(exp)
    send = np.empty(coll.send_count(count, n), storage(cfg.dtype))
    recv = np.empty(coll.recv_count(count, n), storage(cfg.dtype))
    bufs = {False: (send, recv)}
    if any(getattr(i, "shared", False) for i in impls):
        import plait

        bufs[True] = (plait.empty(send.shape, send.dtype), plait.empty(recv.shape, recv.dtype))

    variants, skips = [], []
    for impl in impls:
        for p in cfg.placements:
            why = impl.supports(coll, cfg.dtype, cfg.op, p == IN)
            if why:
                skips.append((impl.name, p, why))
                continue
            s, r = bufs[bool(getattr(impl, "shared", False))]
            x, out, res = coll.views(s, r, rank, n, cfg.root, p == IN)
            v = _Variant(impl, p, x, out, res, r)
            v.fn = impl.prepare(coll, x, out, cfg.dtype, cfg.op, cfg.root)
            variants.append(v)
    if not variants:
        return [], skips

    # Check first: nothing is timed, let alone printed, before its result has been compared.
    wrong = np.zeros(len(variants), np.int64)
    est = np.zeros(len(variants), np.float64)
    for i, v in enumerate(variants):
        _load(v, inp, v.recv, poison=True)
        t0 = time.perf_counter()
        v.fn()
        best = time.perf_counter() - t0
        wrong[i] = count_wrong(v.result, exp)
        if wrong[i]:
            _complain(comm, coll, cfg, nb_of(count, cfg), v, exp, int(wrong[i]))
        for _ in range(cfg.warmup):
            t0 = time.perf_counter()
            v.fn()
            best = min(best, time.perf_counter() - t0)
        est[i] = best
    comm.allreduce(wrong, wrong, op="sum")
    comm.allreduce(est, est, op="max")  # every rank must run the same number of iterations
    for v, e in zip(variants, est):
        v.iters = iterations(cfg, float(e))

    times = np.zeros((len(variants), cfg.trials), np.float64)
    for t in range(cfg.trials):
        for j in range(len(variants)):
            i = (j + t) % len(variants)  # rotate so no implementation always runs first
            v = variants[i]
            if v.placement == IN:
                _load(v, inp, v.recv, poison=False)  # each trial starts from the same data
            comm.barrier()
            fn, k = v.fn, v.iters
            t0 = time.perf_counter_ns()
            for _ in range(k):
                fn()
            times[i, t] = (time.perf_counter_ns() - t0) / k / 1e3
    comm.allreduce(times, times, op="max")

    nb = nb_of(count, cfg)
    records = []
    for i, v in enumerate(variants):
        us = float(np.median(times[i]))
        algbw = nb / (us * 1e-6) / 1e9 if us > 0 else math.inf
        records.append(
            {
                "collective": coll.name,
                "impl": v.impl.name,
                "algorithm": getattr(v.impl, "algorithm", None),
                "placement": v.placement,
                "bytes": nb,
                "count": count,
                "dtype": cfg.dtype,
                "op": cfg.op if coll.reduces else "none",
                "root": cfg.root if coll.rooted else -1,
                "nranks": n,
                "time_us": us,
                "trials_us": [float(x) for x in times[i]],
                "iters": v.iters,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * coll.busbw_factor(n),
                "wrong": int(wrong[i]),
            }
        )
    return records, skips
