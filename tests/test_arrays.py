"""plait's one dtype table (plait._arrays.DTYPES) and everything derived from it agree: numpy,
torch CPU tensors, torch through the backend's windows, GPU arrays and the bench's buffers."""

import numpy as np
import pytest

import plait
from plait import _arrays


@pytest.mark.parametrize("name", list(_arrays.DTYPES))
def test_every_dtype_of_the_table_reduces_exactly(name):
    # A world of one through the store-less path: the table's buffer type is what the core takes.
    from conftest import run_ranks

    def body(rank, n, store):
        comm = plait.init(rank, n, store=store)
        x = np.arange(1, 6).astype(np.dtype(_arrays.DTYPES[name]))
        kw = {"dtype": "bfloat16"} if name == "bfloat16" else {}
        if name == "bfloat16":  # 1..5 as bfloat16 bits
            x = (np.arange(1, 6, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        out = comm.allreduce(x, op="max", **kw)
        assert _arrays.ITEMSIZE[name] == x.itemsize
        return out.tobytes() == x.tobytes()

    assert run_ranks(body, 2, timeout=60) == [True, True]


def test_torch_paths_use_the_table():
    torch = pytest.importorskip("torch")

    names = _arrays.torch_dtypes(torch)
    assert set(names.values()) == set(_arrays.DTYPES)
    assert names[torch.bfloat16] == "bfloat16"
    for dt, name in names.items():
        t = torch.zeros(3, dtype=dt)
        view, override = _arrays.to_numpy(t, "x")
        assert view.dtype == np.dtype(_arrays.DTYPES[name]), name
        assert override == ("bfloat16" if name == "bfloat16" else "")
    assert _arrays.to_numpy(torch.zeros(2, dtype=torch.bfloat16), "x")[0].dtype == np.uint16


def test_bench_storage_comes_from_the_table():
    from plait.bench import collectives

    assert collectives.DTYPES == tuple(_arrays.DTYPES)
    for name in collectives.DTYPES:
        assert np.dtype(collectives.storage(name)) == np.dtype(_arrays.DTYPES[name])


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_reduce_arrays_is_the_host_side_arithmetic(name):
    # What the multi-host layer uses for avg and for half-type reductions over MPI: plait's own
    # kernels, float32 accumulation for half types, one rounding, left to right.
    from plait import _C
    from test_collectives import bf16_to_f32, f32_to_bf16

    def enc(v):
        return f32_to_bf16(v.astype(np.float32)) if name == "bfloat16" else v.astype(_arrays.DTYPES[name])

    def dec(a):
        return bf16_to_f32(a) if name == "bfloat16" else a.astype(np.float64)

    # float16: the sum overflows the type, not its float32 accumulator, so the average is exact.
    big = {"float16": 60000.0, "bfloat16": 2.0**125, "float32": 2.0**125, "float64": 2.0**1000}[name]
    srcs = [enc(np.full(7, big)) for _ in range(3)]
    out = np.empty_like(srcs[0])
    _C.reduce_arrays(out, srcs, name, "avg", 3)
    assert (dec(out) == dec(srcs[0])).all(), dec(out)
    parts = [enc(np.arange(1, 8) * (r + 1)) for r in range(4)]
    _C.reduce_arrays(out, parts, name, "sum")
    assert (dec(out) == np.arange(1, 8) * 10).all()
    _C.reduce_arrays(out, [out], name, "avg", 5)  # in place: the divide of an average
    assert (dec(out) == np.arange(1, 8) * 2).all()
    with pytest.raises(plait.InvalidArgument):
        _C.reduce_arrays(out, [out[:3]], name, "sum")
