"""plait's CUDA reduction kernels alone (no NCCL): every dtype x op with exact values, aligned
(16-byte vectors), equally misaligned (a scalar head, then vectors), misaligned against each
other (8- or 4-byte vectors, or element by element), in place (dst == a) and not, avg (the sum
in float32 for fp16, divided once: fp16 values whose fp16 sum would overflow still average)."""

import pytest

from conftest import run_ranks
from gpu_util import DTYPES, RUN_TIMEOUT, Device, data, expected, ops_for, skip_reason

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))]

# (count, (dst, a, b) offsets in elements)
LAYOUTS = (
    (1, (0, 0, 0)),
    (7, (0, 0, 0)),
    (4097, (0, 0, 0)),
    (4097, (1, 1, 1)),
    (100000, (3, 3, 3)),
    (4099, (0, 2, 4)),
    (4099, (1, 3, 2)),
    (33, (0, 1, 0)),
    (5000, (2, 2, 6)),
)


def _kernels(rank, n, store):
    import numpy as np

    from plait import _C

    dev = Device(0)
    ptr = (lambda t: t.data_ptr()) if dev.torch is not None else (lambda t: t.data.ptr)
    stream = (
        dev.torch.cuda.current_stream().cuda_stream
        if dev.torch is not None
        else dev.cupy.cuda.get_current_stream().ptr
    )
    bad = []

    def placed(host, shift):
        buf = np.zeros(len(host) + shift, dtype=host.dtype)
        buf[shift:] = host
        return dev.put(buf)[0]

    for dtype in DTYPES:
        for op in ops_for(dtype):
            for count, (sd, sa, sb) in LAYOUTS:
                for in_place in (False, True):
                    if in_place and sd != sa:
                        continue
                    a_host, b_host = data(dtype, op, 0, 2, count), data(dtype, op, 1, 2, count)
                    a, b = placed(a_host, sa), placed(b_host, sb)
                    dst = a if in_place else dev.empty(a, count + sd)
                    size = a_host.itemsize
                    _C._reduce_cuda(
                        dtype,
                        op,
                        ptr(dst) + sd * size,
                        ptr(a) + sa * size,
                        ptr(b) + sb * size,
                        count,
                        2 if op == "avg" else 0,
                        stream,
                    )
                    got = dev.get(dst, dtype)[sd:]
                    want = expected(dtype, op, 2, count)
                    if not np.array_equal(got, want):
                        bad.append(
                            f"{dtype}/{op}/count {count}/offsets {(sd, sa, sb)}/in_place {in_place}: "
                            f"got {got[:4]}, want {want[:4]}"
                        )
    # fp16 avg of two values near 6e4: their sum (1.2e5) is inf in fp16, their average is not.
    big = np.full(1027, 60000, dtype=np.float16)
    a, b = dev.put(big)[0], dev.put(big)[0]
    _C._reduce_cuda("float16", "avg", ptr(a), ptr(a), ptr(b), 1027, 2, stream)
    got = dev.get(a, "float16")
    if not np.array_equal(got, big):
        bad.append(f"float16 avg of 60000 and 60000: got {got[:4]} (the float32 sum must keep it finite)")
    return bad


def test_every_dtype_and_op_exactly():
    (bad,) = run_ranks(_kernels, 1, RUN_TIMEOUT, start_method="spawn")
    assert not bad, "\n".join(bad[:20])
