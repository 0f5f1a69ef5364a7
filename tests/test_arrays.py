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
    from plait.torch import _tensors

    names = _arrays.torch_dtypes(torch)
    assert set(names.values()) == set(_arrays.DTYPES)
    assert names[torch.bfloat16] == "bfloat16"
    for dt, name in names.items():
        t = torch.zeros(3, dtype=dt)
        view, override = _arrays.to_numpy(t, "x")
        assert view.dtype == np.dtype(_arrays.DTYPES[name]), name
        assert override == ("bfloat16" if name == "bfloat16" else "")
        window, override2 = _tensors.np_of(t)
        assert window.dtype == view.dtype, name  # the backend and the direct API read the same bytes
        assert (override2 or "") == override
        assert _tensors.NATIVE[dt] == name
    assert _arrays.to_numpy(torch.zeros(2, dtype=torch.bfloat16), "x")[0].dtype == np.uint16


def test_bench_storage_comes_from_the_table():
    from plait.bench import collectives

    assert collectives.DTYPES == tuple(_arrays.DTYPES)
    for name in collectives.DTYPES:
        assert np.dtype(collectives.storage(name)) == np.dtype(_arrays.DTYPES[name])
