"""plait's CUDA reduction kernels alone (no NCCL): every dtype x op with exact values, aligned
(16-byte vectors) and unaligned (scalar path), in place (dst == a) and not, avg's division."""
import pytest

from conftest import run_ranks
from gpu_util import DTYPES, Device, data, expected, ops_for, skip_reason

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))]


def _kernels(rank, n, store):
    import numpy as np

    from plait import _C
    dev = Device(0)
    bad = []
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for count, shift in ((1, 0), (7, 0), (4097, 0), (4097, 1), (100000, 3)):
                a_host, b_host = data(dtype, op, 0, 2, count + shift), data(dtype, op, 1, 2, count + shift)
                for in_place in (False, True):
                    a, _ = dev.put(a_host)
                    b, _ = dev.put(b_host)
                    dst = a if in_place else dev.empty(a, count + shift)
                    ptr = (lambda t: t.data_ptr()) if dev.torch is not None else (lambda t: t.data.ptr)
                    size = a_host.itemsize
                    stream = (dev.torch.cuda.current_stream().cuda_stream if dev.torch is not None
                              else dev.cupy.cuda.get_current_stream().ptr)
                    _C._reduce_cuda(dtype, op, ptr(dst) + shift * size, ptr(a) + shift * size,
                                    ptr(b) + shift * size, count, 2 if op == "avg" else 0, stream)
                    got = dev.get(dst, dtype)[shift:]
                    want = expected(dtype, op, 2, count + shift)[shift:]
                    if not np.array_equal(got, want):
                        bad.append(f"{dtype}/{op}/count {count}/shift {shift}/in_place {in_place}: "
                                   f"got {got[:4]}, want {want[:4]}")
    return bad


def test_every_dtype_and_op_exactly():
    bad, = run_ranks(_kernels, 1, 300, start_method="spawn")
    assert not bad, "\n".join(bad[:20])
