"""Helpers for the GPU tests: how many devices (asked in a subprocess, so this process never
initialises CUDA before run_ranks spawns ranks), device arrays through torch or cupy, and the
closed-form data and expected values the collectives are checked against."""

import os
import subprocess
import sys

import numpy as np

# Each spawned test's hard bound (run_ranks): run.sh lowers it to fit a short GPU lease.
RUN_TIMEOUT = int(os.environ.get("PLAIT_GPU_TEST_TIMEOUT", "300"))
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
OPS = ("sum", "prod", "min", "max", "avg")


def _probe():
    # run.sh probes once and exports the answer: no extra subprocess per rank of every test.
    if os.environ.get("PLAIT_GPU_PROBE"):
        return tuple(int(v) for v in os.environ["PLAIT_GPU_PROBE"].split())
    code = (
        "import plait, importlib.util as u\n"
        "print(int(plait.build_info()['cuda']), plait._C.cuda_device_count(),"
        " int(u.find_spec('torch') is not None), int(u.find_spec('cupy') is not None))"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ)
        ).stdout.split()
        return tuple(int(v) for v in out)
    except Exception:  # noqa: BLE001 - no answer means no GPU for these tests
        return (0, 0, 0, 0)


CUDA_BUILD, DEVICES, _HAS_TORCH, _HAS_CUPY = _probe()
if os.environ.get("PLAIT_GPU_REQUIRED") == "1" and not (CUDA_BUILD and DEVICES):
    # run.sh on a GPU machine: a test that would skip for want of a device is an error there.
    raise RuntimeError(f"PLAIT_GPU_REQUIRED=1 but cuda build={CUDA_BUILD}, devices={DEVICES}")


def skip_reason(need=1):
    if not CUDA_BUILD:
        return "plait was built without CUDA (plait.build_info()['cuda'] is False)"
    if DEVICES < need:
        return f"needs {need} CUDA device(s), this machine has {DEVICES}"
    return None


def ops_for(dtype):
    if dtype == "bool":
        return ("sum", "prod", "min", "max")
    return OPS if dtype in ("float16", "bfloat16", "float32", "float64") else OPS[:4]


def _np_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def data(dtype, op, rank, n, count):
    """Integer-valued data, small enough that every reduction over <= 8 ranks is exact."""
    i = np.arange(count, dtype=np.int64)
    if dtype == "bool":
        v = (i + rank) % 3 == 0
    elif op == "prod":
        v = 1 + (i + rank) % 2
    elif op in ("min", "max"):
        v = (3 * i + 5 * rank) % 11
    elif op == "avg":
        v = n * (i % 5 + rank)  # multiples of n: exact in plait's avg (sum, divide) and NCCL's (x / n, sum)
    else:
        v = i % 13 + rank
    return v.astype(_np_dtype(dtype))


def gpu_sleep_cycles(seconds):
    """Cycles for torch.cuda._sleep to keep the GPU busy at least `seconds` (at <= 2 GHz)."""
    return int(seconds * 2e9)


def expected(dtype, op, n, count):
    """The reduction of data(dtype, op, r, n, count) over r < n."""
    rows = np.stack([data(dtype, op, r, n, count).astype(np.float64) for r in range(n)])
    if dtype == "bool":
        red = rows.max(0) if op in ("sum", "max") else rows.min(0)
        return red.astype(bool)
    red = {
        "sum": rows.sum(0),
        "prod": rows.prod(0),
        "min": rows.min(0),
        "max": rows.max(0),
        "avg": rows.sum(0) / n,
    }[op]
    return red.astype(_np_dtype(dtype))


class Device:
    """Device arrays on one GPU through torch (preferred) or cupy."""

    def __init__(self, index):
        self.index = index
        try:
            import torch

            if not torch.cuda.is_available():
                raise ImportError
            self.torch = torch
            torch.cuda.set_device(index)
        except ImportError:
            self.torch = None
            import cupy

            self.cupy = cupy
            cupy.cuda.Device(index).use()

    def put(self, a):
        """(device array, dtype override) holding numpy array a."""
        if self.torch is not None:
            t = self.torch
            if a.dtype.name == "bfloat16":
                return t.from_numpy(a.view(np.int16).copy()).view(t.bfloat16).cuda(self.index), None
            return t.from_numpy(np.ascontiguousarray(a)).cuda(self.index), None
        if a.dtype.name == "bfloat16":
            return self.cupy.asarray(a.view(np.uint16)), "bfloat16"
        return self.cupy.asarray(a), None

    def empty(self, like, count):
        if self.torch is not None:
            return self.torch.empty(count, dtype=like.dtype, device=f"cuda:{self.index}")
        return self.cupy.empty(count, dtype=like.dtype)

    def get(self, x, dtype):
        if self.torch is not None:
            self.torch.cuda.synchronize(self.index)
            if x.dtype == self.torch.bfloat16:
                return x.view(self.torch.int16).cpu().numpy().view(_np_dtype("bfloat16"))
            return x.cpu().numpy()
        self.cupy.cuda.get_current_stream().synchronize()
        a = self.cupy.asnumpy(x)
        return a.view(_np_dtype("bfloat16")) if dtype == "bfloat16" else a
