"""Half types (float16, bfloat16) reduce in float32 and round once, whatever the algorithm.

docs/api.md promises that sum and avg of half types accumulate in float32 and round once. Multi-hop
algorithms (ring, tree) used to round every partial to the half type, so an fp16 average of 60000s
overflowed to inf and precise data came out a bit off. Here every reducing collective and
algorithm, at world sizes 1, 2, 3, 4 and 8, must give the closed-form result for values near the
type's range limit, and the same bytes as allreduce one_shot for values whose float32 sums are
exact (so any order of summation agrees). A small staging buffer forces the multi-chunk paths,
where the float32 partials need twice the staging bytes of the half elements.
"""

import numpy as np
import pytest

import plait
from conftest import run_ranks
from test_collectives import Check, bf16_to_f32, f32_to_bf16

WORLD_SIZES = (1, 2, 3, 4, 8)
COLLS = ("allreduce", "reduce_scatter", "reduce")
DTYPES = ("float16", "bfloat16")
COUNT = 4096  # per rank block, as in the probe: np.full(size * 4096, 60000, np.float16)


def to_half(v, dt):
    """float32 values -> the stored half type (bfloat16 as raw uint16 bits)."""
    v = np.asarray(v, np.float32)
    return f32_to_bf16(v) if dt == "bfloat16" else v.astype(np.float16)


def to_f32(a, dt):
    return bf16_to_f32(a) if dt == "bfloat16" else np.asarray(a).astype(np.float32)


def kw(dt):
    return {"dtype": "bfloat16"} if dt == "bfloat16" else {}


def near_max(dt, n):
    """A value near dt's largest finite one whose n-fold float32 sum stays finite and exact: 60000 for
    float16 (the issue's value); for bfloat16 the largest value with all 8 significand bits set (so
    that a partial sum rounded to bfloat16 loses bits) whose n-fold sum fits float32."""
    if dt == "float16":
        return np.float32(60000.0)
    e = 127
    while np.float32(n) * np.float32((2 - 2**-7) * 2.0**e) == np.inf:
        e -= 1
    return np.float32((2 - 2**-7) * 2.0**e)


def run(comm, coll, x, algo, op, dt):
    """The collective's result on this rank: the full vector for allreduce, this rank's block for
    reduce_scatter, and for reduce the root's vector (root n - 1, broadcast so all ranks check it)."""
    if coll == "allreduce":
        return comm.allreduce(x, op=op, algorithm=algo, **kw(dt))
    if coll == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, algorithm=algo, **kw(dt))
    root = comm.size - 1
    out = comm.reduce(x, root=root, op=op, algorithm=algo, **kw(dt))
    if out is None:
        out = np.empty_like(x)
    return comm.broadcast(out, root=root, **kw(dt))


def mine(vec, coll, rank, m):
    return vec[rank * m : (rank + 1) * m] if coll == "reduce_scatter" else vec


def _body(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=60, buffer_bytes=8192)
    chk = Check(rank)
    skipped = set()
    for coll in COLLS:
        for algo in plait.algorithms(coll):
            if algo in ("single_copy", "shared_or_staged") and n > 1 and not comm.single_copy:
                skipped.add(coll)
                continue
            for dt in DTYPES:
                v = near_max(dt, n)
                # avg of n equal values: exactly v. sum: +v on the first ceil(n/2) ranks, -v on the
                # rest, so the total is v or 0 while a partial of two +v's is past float16's range.
                for op, sign in (("avg", 1), ("sum", 1 if rank < (n + 1) // 2 else -1)):
                    x = to_half(np.full(n * COUNT, sign * v), dt)
                    want = to_half(
                        np.full(
                            COUNT * (1 if coll == "reduce_scatter" else n), v if op == "avg" or n % 2 else 0
                        ),
                        dt,
                    )
                    label = "%s %s %s %s near max (%g)" % (coll, algo, dt, op, v)
                    chk.eq(label, run(comm, coll, x, algo, op, dt), want)

                # Inexact-looking values whose float32 sums are exact: bitwise one_shot's result.
                m = 1001
                i = np.arange(n * m)
                for op in ("sum", "avg"):
                    x = to_half(0.1 * (rank + 1) + i * 1e-3, dt)
                    ref = comm.allreduce(x, op=op, algorithm="one_shot", **kw(dt))
                    xs = [to_f32(to_half(0.1 * (r + 1) + i * 1e-3, dt), dt) for r in range(n)]
                    total = np.add.reduce(np.stack(xs), axis=0, dtype=np.float32)
                    exact = to_half(total / np.float32(n) if op == "avg" else total, dt)
                    chk.eq("one_shot %s %s against numpy" % (dt, op), ref, exact)
                    got = run(comm, coll, x, algo, op, dt)
                    chk.eq(
                        "%s %s %s %s against one_shot" % (coll, algo, dt, op), got, mine(ref, coll, rank, m)
                    )
    comm.finalize()
    return {"skipped": sorted(skipped), "wrong": chk.wrong}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_half_types_round_once_in_every_algorithm(n):
    results = run_ranks(_body, n, timeout=240 if n < 8 else 420)
    for rank, res in enumerate(results):
        assert not res["wrong"], "rank %d: %d wrong result(s):\n  %s" % (
            rank,
            len(res["wrong"]),
            "\n  ".join(res["wrong"][:20]),
        )
