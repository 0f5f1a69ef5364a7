"""GPU collectives on data that catches ordering and arithmetic bugs the small-integer sweeps
cannot: values distinct per rank and element (a block read from the wrong rank, offset or
epoch shows), NaN/inf, integer wrap-around, fp16 avg whose fp16 sum would overflow (plait sums
in float32 and divides once), views at odd byte offsets, large counts through the default staging.
Several processes on one GPU go through the CUDA IPC transport; what needs a GPU per rank says
so when it skips."""

import pytest

from conftest import run_ranks
from gpu_util import RUN_TIMEOUT, Device, skip_reason

pytestmark = pytest.mark.cuda
IPC_ALGOS = ("one_shot", "two_shot", "ring")


def _rows(case, n, count):
    """Every rank's input (float64 or int64 rows), exactly representable in the tested dtype."""
    import numpy as np

    i = np.arange(count, dtype=np.int64)
    if case == "distinct":  # < 2^11 per entry: exact in fp16 sums of <= 4 ranks
        return np.stack([((i * 7 + 131 * r) % 509) for r in range(n)]).astype(np.float64)
    if case == "nan_inf":
        rows = np.stack([(i % 11 + r) for r in range(n)]).astype(np.float64)
        rows[0, 3::17] = np.nan
        rows[1 % n, 5::17] = np.inf
        rows[n - 1, 7::17] = -np.inf  # for n >= 3, with rank 1's +inf at the same index: NaN
        rows[1 % n, 7::17] = np.inf
        return rows
    if case == "wrap":
        return np.stack([(i * 37 + 100 * r) % 256 - 128 for r in range(n)])
    if case == "avg_overflow":  # sum of n values near 3e4 overflows fp16; the average does not
        return np.full((n, count), 30000.0)
    raise ValueError(case)


def _expect(rows, dtype, op):
    import numpy as np

    if dtype == "int8":
        acc = rows.sum(0) if op == "sum" else rows.max(0)
        return acc.astype(np.int64).astype(np.int8)  # two's complement wrap, as the kernels do
    red = {"sum": rows.sum(0), "max": rows.max(0), "min": rows.min(0), "avg": rows.sum(0) / len(rows)}[op]
    return red.astype(dtype)


def _values(rank, n, store, cases, shifts=(0,), counts=(1027,), gpu_per_rank=False):
    import numpy as np

    import plait

    dev = Device(rank if gpu_per_rank else 0)
    comm = plait.init(rank, n, store=store)
    bad, runs = [], 0
    for case, dtype, op in cases:
        for count in counts:
            rows = _rows(case, n, count)
            want = _expect(rows, dtype, op)
            for shift in shifts:
                for algo in IPC_ALGOS:
                    runs += 1
                    host = np.zeros(count + shift, dtype=dtype)
                    host[shift:] = rows[rank].astype(dtype)
                    big, _ = dev.put(host)
                    x = big[shift:]  # a view `shift` elements in: odd byte offsets for shift 1
                    out_big = dev.empty(big, count + 3)
                    out = out_big[3:]  # misaligned against the input by 3 elements
                    comm.allreduce(x, out=out, op=op, algorithm=algo)
                    got = dev.get(out, dtype)
                    same = np.array_equal(got, want, equal_nan=got.dtype.kind == "f")
                    if not same:
                        diff = np.flatnonzero(
                            ~(
                                (got == want) | (np.isnan(got) & np.isnan(want))
                                if got.dtype.kind == "f"
                                else got == want
                            )
                        )[:3]
                        bad.append(
                            f"rank {rank}: {case}/{dtype}/{op}/{algo}/count {count}/shift {shift}: "
                            f"differences at {list(diff)}: got {got[diff]}, want {want[diff]}"
                        )
    return runs, bad[:10]


def _check(results):
    assert all(runs > 0 for runs, _ in results)
    bad = [line for _, lines in results for line in lines]
    assert not bad, "\n".join(bad)


CASES = [
    ("distinct", "float32", "sum"),
    ("distinct", "float16", "sum"),
    ("distinct", "float32", "max"),
    ("nan_inf", "float32", "sum"),
    ("nan_inf", "float16", "max"),
    ("nan_inf", "float32", "min"),
    ("wrap", "int8", "sum"),
    ("avg_overflow", "float16", "avg"),
    ("avg_overflow", "float32", "avg"),
]


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ipc_values_on_one_gpu(n):
    _check(
        run_ranks(
            _values,
            n,
            RUN_TIMEOUT,
            args=(CASES, (0, 1)),
            env={"PLAIT_GPU_IPC_BYTES": "8192"},
            start_method="spawn",
        )
    )


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
def test_ipc_large_count_default_staging():
    # 2^23 + 5 floats (32 MiB): four windows of the default 8 MiB staging and a ragged last one.
    _check(
        run_ranks(
            _values,
            2,
            RUN_TIMEOUT,
            args=([("distinct", "float32", "sum")], (0, 1), ((1 << 23) + 5,)),
            start_method="spawn",
        )
    )


@pytest.mark.skipif(skip_reason(2) is not None, reason=f"IPC across GPUs (P2P/NVLink): {skip_reason(2)}")
def test_ipc_values_across_gpus():
    _check(
        run_ranks(
            _values,
            2,
            RUN_TIMEOUT,
            args=(CASES, (0, 1), (1027,), True),
            env={"PLAIT_GPU_TRANSPORT": "ipc", "PLAIT_GPU_IPC_BYTES": "8192"},
            start_method="spawn",
        )
    )


def _captured(rank, n, store):
    import numpy as np

    import plait

    dev = Device(0)
    torch = dev.torch
    comm = plait.init(rank, n, store=store)
    x, _ = dev.put(np.ones(8, np.float32))
    comm.allreduce(x, out=x)  # the GPU communicator exists before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            comm.allreduce(x, out=x)
    except Exception as e:  # noqa: BLE001 - ending the capture may raise too: keep plait's error
        return " | ".join(f"{type(x).__name__}: {x}" for x in (e, e.__context__) if x is not None)
    return "no error"


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_stream_capture_is_refused_clearly(transport):
    (msg,) = run_ranks(
        _captured, 1, RUN_TIMEOUT, env={"PLAIT_GPU_TRANSPORT": transport}, start_method="spawn"
    )
    assert "InvalidArgument" in msg and "captured into a CUDA graph" in msg and "allreduce" in msg, msg
