"""The GPU path's CPU-side contract (runs on every machine): build facts, the host-side planners
with closed-form expectations, and how GPU inputs are recognised and refused when they cannot run
(a CPU-only build, no device, host/device mix-ups, wrong devices) on every rank.
"""
import importlib.util
import os
import shutil

import numpy as np
import pytest

import plait
from plait import _C, _arrays, _cuda
from conftest import run_ranks

RUN_TIMEOUT = 60


# -- build facts ------------------------------------------------------------------------------
def test_build_info_keys_and_meaning():
    info = plait.build_info()
    assert isinstance(info["cuda"], bool)
    assert isinstance(info["cuda_devices"], int) and info["cuda_devices"] >= 0
    assert info["nccl"] is None or len(info["nccl"].split(".")) == 3
    assert plait.cuda_available() == (info["cuda"] and info["cuda_devices"] > 0)
    assert ("nccl" in info["transports"]) == info["cuda"]
    assert info["reduce_isa"] in ("avx512", "avx2", "portable")


def test_cuda_did_not_silently_drop_out_of_the_build():
    """CI builds with AUTO on a machine with nvcc: the module must then have the CUDA path."""
    if os.environ.get("PLAIT_CUDA", "").upper() == "OFF":
        pytest.skip("PLAIT_CUDA=OFF asked for a CPU-only build")
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on PATH: a CPU-only build is expected")
    assert plait.build_info()["cuda"], (
        "nvcc is on PATH but plait was built without CUDA: the GPU sources were not compiled")


@pytest.mark.skipif(not _cuda.compiled(), reason="CPU-only build")
def test_nccl_loads_from_the_wheel_without_a_gpu():
    if importlib.util.find_spec("nvidia.nccl") is None:
        pytest.skip("nvidia-nccl-cu13 is not installed")
    from importlib.metadata import version
    path = plait.build_info()["nccl_path"]
    assert path and path.endswith("libnccl.so.2") and os.path.exists(path)
    assert plait.build_info()["nccl"] == ".".join(version("nvidia-nccl-cu13").split(".")[:3])
    assert len(_C.nccl_unique_id(path)) == 128  # NCCL's bootstrap id needs no GPU


def test_gpu_algorithm_names():
    want = {"allreduce": ["nccl", "ring", "tree", "one_shot", "two_shot"], "reduce_scatter": ["nccl", "ring", "one_shot"],
            "allgather": ["nccl", "ring", "one_shot"], "broadcast": []}
    for coll, names in want.items():
        assert plait.algorithms(coll, device="cuda") == (names if _cuda.compiled() else [])
    assert plait.algorithms("allreduce") == plait.algorithms("allreduce", device="cpu")
    with pytest.raises(plait.InvalidArgument):
        plait.algorithms("allreduce", device="tpu")


# -- planners ---------------------------------------------------------------------------------
@pytest.mark.parametrize("count,chunk", [(0, 1), (1, 1), (10, 4), (12, 4), (7, 100), (1 << 20, 3)])
def test_chunk_plan(count, chunk):
    plan = _C.gpu_plan_chunks(count, chunk)
    assert len(plan) == -(-count // chunk)
    assert [off for off, _ in plan] == [i * chunk for i in range(len(plan))]
    assert all(n == chunk for _, n in plan[:-1])
    assert sum(n for _, n in plan) == count


def test_chunk_plan_rejects_bad_sizes():
    for count, chunk in ((-1, 4), (4, 0)):
        with pytest.raises(plait.InvalidArgument):
            _C.gpu_plan_chunks(count, chunk)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_ring_plan_reduces_and_gathers_every_block(n):
    plans = [_C.gpu_plan_ring(r, n) for r in range(n)]
    for r, p in enumerate(plans):
        assert (p["left"], p["right"]) == ((r - 1) % n, (r + 1) % n)
        assert len(p["reduce_scatter"]) == len(p["allgather"]) == n - 1
    # Reduce-scatter: each rank's partial of a block is the set of ranks folded into it.
    held = [{b: {r} for b in range(n)} for r in range(n)]
    for s in range(n - 1):
        sent = [(p["reduce_scatter"][s][0], held[r][p["reduce_scatter"][s][0]]) for r, p in enumerate(plans)]
        for r, p in enumerate(plans):
            block, partial = sent[p["left"]]
            assert block == p["reduce_scatter"][s][1], "a rank receives the block its left neighbour sends"
            held[r][block] = partial | {r}
    for r in range(n):
        assert held[r][r] == set(range(n)), f"rank {r} ends with block {r} fully reduced"
    # Allgather: rank r starts with block r and ends with all of them.
    have = [{r} for r in range(n)]
    for s in range(n - 1):
        sent = [p["allgather"][s][0] for p in plans]
        for r, p in enumerate(plans):
            assert sent[p["left"]] in have[p["left"]] and sent[p["left"]] == p["allgather"][s][1]
        for r, p in enumerate(plans):
            have[r].add(sent[p["left"]])
    assert all(h == set(range(n)) for h in have)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16])
def test_tree_links(n):
    links = [_C.gpu_plan_tree(r, n) for r in range(n)]
    assert links[0][0] == -1
    for r, (parent, children) in enumerate(links):
        assert children == [c for c in (2 * r + 1, 2 * r + 2) if c < n]
        for c in children:
            assert links[c][0] == r
        depth, at = 0, r
        while at != 0:
            at, depth = links[at][0], depth + 1
        assert depth <= (n).bit_length() - 1, "a heap-ordered binary tree is log2(n) deep"


def test_planners_reject_ranks_outside_the_world():
    for fn in (_C.gpu_plan_ring, _C.gpu_plan_tree):
        with pytest.raises(plait.InvalidArgument):
            fn(3, 3)
        with pytest.raises(plait.InvalidArgument):
            fn(0, 0)


# -- recognising device arrays ----------------------------------------------------------------
class FakeCuda:
    """An object that claims to be a CUDA array (nothing is ever read through its pointer)."""

    def __init__(self, shape=(8,), typestr="<f4", ptr=1 << 40, strides=None, stream=None):
        self.shape = shape
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr,
                                         "strides": strides, "version": 3, "stream": stream}


class FakeDlpack:
    shape = (8,)

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0


def test_detection():
    assert _arrays.is_gpu(FakeCuda()) and _arrays.is_gpu(FakeDlpack())
    assert not _arrays.is_gpu(np.zeros(3))
    torch = pytest.importorskip("torch")
    assert not _arrays.is_gpu(torch.zeros(3))
    assert not _arrays.is_gpu(torch.zeros(3, device="meta"))


def test_gpu_array_reads_the_interface():
    g = _arrays.gpu_array(FakeCuda((4, 6), "<i8", ptr=(3 << 40) + 256, stream=7), "input", lambda p: p >> 40)
    assert (g.ptr, g.nbytes, g.itemsize, g.count, g.device, g.dtype, g.stream) == (
        (3 << 40) + 256, 4 * 6 * 8, 8, 24, 3, "int64", 7)
    assert g.describe().endswith("int64 x 24 on GPU 3")
    for typestr, name in (("<f2", "float16"), ("<f8", "float64"), ("|i1", "int8"), ("|u1", "uint8"),
                          ("<i4", "int32"), ("|b1", "bool"), ("<c8", None)):
        assert _arrays.gpu_array(FakeCuda(typestr=typestr), "x", lambda p: 0).dtype == name
    with pytest.raises(plait.InvalidArgument, match="C-contiguous"):
        _arrays.gpu_array(FakeCuda((4, 6), strides=(4, 16)), "input", lambda p: 0)
    with pytest.raises(plait.InvalidArgument, match="only DLPack"):
        _arrays.gpu_array(FakeDlpack(), "input", lambda p: 0)


# -- refusing what cannot run, on every rank ---------------------------------------------------
def _refused(rank, n, store, case):
    import plait as p
    from plait import _cuda as cu
    comm = p.init(rank, n, store=store)
    if case in ("wrong_device", "bad_dtype_override"):
        # Pretend to be a CUDA build with two devices: the device check must come first.
        cu.compiled = lambda: True
        cu.device_count = lambda: 2
        p._C.cuda_pointer_device = lambda ptr: ptr >> 40
    x = np.arange(8, dtype=np.float32)
    calls = {
        "gpu_input": lambda: comm.allreduce(FakeCuda() if rank == 0 else x),
        "mixed": lambda: comm.allreduce(FakeCuda(), out=np.zeros(8, np.float32)),
        "dlpack_only": lambda: comm.allreduce(FakeDlpack(), out=FakeDlpack()),
        "not_a_gpu_collective": lambda: comm.broadcast(FakeCuda()),
        "wrong_device": lambda: comm.allreduce(FakeCuda(ptr=1 << 40), out=FakeCuda(ptr=2 << 40)),
        "bad_dtype_override": lambda: comm.allreduce(FakeCuda(ptr=1 << 40), out=FakeCuda(ptr=1 << 40), dtype="bfloat16"),
    }
    try:
        calls[case]()
    except p.PlaitError as e:
        return type(e).__name__, str(e)
    return None, "no error"


@pytest.mark.parametrize("case,pattern", [
    ("gpu_input", None),
    ("mixed", r"output is a host array \(ndarray\) and the other a GPU array"),
    ("dlpack_only", r"offers only DLPack"),
    ("not_a_gpu_collective", r"broadcast.*GPU arrays are taken by allreduce, reduce_scatter, allgather only"),
    ("wrong_device", r"input on GPU 1, output on GPU 2"),
    ("bad_dtype_override", r"dtype='bfloat16' needs 2-byte elements, the arrays have 4 and 4"),
])
def test_gpu_input_that_cannot_run_fails_on_every_rank(case, pattern):
    if pattern is None:
        pattern = (r"no CUDA device is visible" if _cuda.compiled() and _cuda.device_count() == 0
                   else r"no CUDA path" if not _cuda.compiled() else None)
        if pattern is None:
            pytest.skip("this machine has a CUDA device: the GPU input would run")
    results = run_ranks(_refused, 2, RUN_TIMEOUT, args=(case,))
    for rank, (cls, msg) in enumerate(results):
        assert cls == "InvalidArgument", f"rank {rank}: {cls}: {msg}"
        who = "rank 0" if case == "gpu_input" else "rank "  # elsewhere every rank fails alike
        assert who in msg, f"rank {rank}: the message names the rank that failed: {msg}"
        assert __import__("re").search(pattern, msg), f"rank {rank}: {msg}"
    if case == "gpu_input":
        assert "allreduce" in results[1][1] and "float32 x 8" in results[1][1]


def _gpu_comm_rank(rank, n, store):
    import plait as p
    comm = p.init(rank, n, store=store)
    errs = []
    for r, s in ((-1, 2), (2, 2), (0, 0), (3, -1), (-1, 5)):
        try:
            _C.GpuCommunicator(comm._c, bytes(128), 0, 1.0, 4096, "", "", rank=r, size=s)
            errs.append("no error")
        except p.InvalidArgument as e:
            errs.append(str(e))
    comm.finalize()
    return errs


@pytest.mark.skipif(not _cuda.compiled(), reason="CPU-only build")
def test_gpu_communicator_rank_override_is_checked_before_nccl():
    """A HierCommunicator passes its global rank/size with the host-local CPU communicator."""
    errs, = run_ranks(_gpu_comm_rank, 1, RUN_TIMEOUT)
    for (r, s), msg in zip(((-1, 2), (2, 2), (0, 0), (3, -1), (-1, 5)), errs):
        assert f"rank {r} of size {s}: need 0 <= rank < size" in msg, msg


def test_torch_backend_is_registered_for_cuda_too():
    dist = pytest.importorskip("torch.distributed")
    import plait.torch  # noqa: F401 - registers the backend
    assert set(dist.Backend.backend_capability["plait"]) == {"cpu", "cuda"}


def test_bench_device_cuda_says_why_it_cannot_run():
    if plait.cuda_available():
        pytest.skip("this machine has a CUDA device: tests/gpu/run.sh runs the GPU bench")
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "plait.bench", "--device", "cuda", "-n", "1", "-b", "1K", "-e", "1K"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "no CUDA device is visible" in r.stderr or "no CUDA path" in r.stderr, r.stderr
