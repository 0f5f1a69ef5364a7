"""The GPU path's CPU-side contract (runs on every machine): build facts, the host-side planners
with closed-form expectations, and how GPU inputs are recognised and refused when they cannot run
(a CPU-only build, no device, host/device mix-ups, wrong devices) on every rank.
"""

import importlib.util
import os
import shutil

import numpy as np
import time

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
        "nvcc is on PATH but plait was built without CUDA: the GPU sources were not compiled"
    )


@pytest.mark.skipif(not _cuda.compiled(), reason="CPU-only build")
def test_nccl_loads_from_the_wheel_without_a_gpu():
    # find_spec of a dotted name imports the parent: without any nvidia wheel that raises.
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.nccl") is None:
        pytest.skip("nvidia-nccl-cu13 is not installed")
    from importlib.metadata import version

    path = plait.build_info()["nccl_path"]
    assert path and path.endswith("libnccl.so.2") and os.path.exists(path)
    assert plait.build_info()["nccl"] == ".".join(version("nvidia-nccl-cu13").split(".")[:3])
    assert len(_C.nccl_unique_id(path)) == 128  # NCCL's bootstrap id needs no GPU


def test_gpu_algorithm_names():
    # The transports' rows are listed once, in test_algo_table; here, how plait.algorithms merges them.
    from test_algo_table import IPC, NCCL

    for coll, names in NCCL.items():
        merged = names + [n for n in IPC.get(coll, []) if n not in names]
        assert plait.algorithms(coll, device="cuda") == (merged if _cuda.compiled() else [])
        assert _C.algorithms(coll, "ipc") == (IPC.get(coll, []) if _cuda.compiled() else [])
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
        for p in plans:
            assert sent[p["left"]] in have[p["left"]] and sent[p["left"]] == p["allgather"][s][1]
        for r, p in enumerate(plans):
            have[r].add(sent[p["left"]])
    assert all(h == set(range(n)) for h in have)


def _simulate_ipc_ring(coll, n, count, slot):
    """Runs every rank's ipc_ring_plan in lockstep as the GPU does: a step reads the left
    neighbour's slot (read % 2) after it posted `read`, and overwrites its own slot only after the
    right neighbour read what was there. Values carry the set of ranks folded in, so a rank counted
    twice or missing shows, and the arithmetic is the exact sum of a closed formula."""
    plans = [_C.gpu_plan_ipc_ring(coll, r, n, count, slot) for r in range(n)]
    assert len({len(p) for p in plans}) == 1, "every rank takes the same number of steps"
    ins, outs = {
        "allreduce": (count, count),
        "reduce_scatter": (n * count, count),
        "allgather": (count, n * count),
    }[coll]
    inp = [np.arange(ins, dtype=np.int64) * (r + 1) + r for r in range(n)]
    out = [np.full(outs, -1, dtype=np.int64) for _ in range(n)]
    if coll == "allgather":  # the algorithm copies a rank's own block; the plan moves the others
        for r in range(n):
            out[r][r * count : (r + 1) * count] = inp[r]
    staging = [[None, None] for _ in range(n)]  # per slot: (epoch, values, ranks folded in, read)
    finished = []  # (rank, block, count)
    for i in range(len(plans[0])):
        steps = [p[i] for p in plans]
        assert len({(k, rd, po) for k, _, _, _, _, rd, po in steps}) == 1, (
            "all ranks take the same kind of step, same epochs"
        )
        got = []
        for r, (_kind, _block, _ioff, _ooff, cnt, read, _post) in enumerate(steps):
            assert 0 <= cnt <= slot
            src = None
            if read:
                e, vals, ranks, done = staging[(r - 1) % n][read % 2]
                assert e == read and not done, f"rank {r} reads left's epoch {read} once, while it is there"
                src = (vals, ranks)
                staging[(r - 1) % n][read % 2] = (e, vals, ranks, True)
            got.append(src)
        for r, (kind, block, ioff, ooff, cnt, _read, post) in enumerate(steps):
            src = got[r]
            if kind != "gather":
                assert 0 <= ioff and ioff + cnt <= ins
                mine = inp[r][ioff : ioff + cnt]
            if kind in ("finish", "gather"):
                assert 0 <= ooff and ooff + cnt <= outs
            if kind == "load":
                vals, ranks = mine.copy(), {r}
            elif kind in ("reduce", "finish"):
                assert r not in src[1], f"rank {r} folds into block {block} once"
                vals, ranks = src[0] + mine, src[1] | {r}
                if kind == "finish":
                    assert ranks == set(range(n)) and block == r, (
                        f"rank {r} finishes block {r}, with every rank in it"
                    )
                    finished.append((r, block, cnt))
                    out[r][ooff : ooff + cnt] = vals
            else:
                assert src[1] == ({block} if coll == "allgather" else set(range(n))), (
                    "gathers forward finished blocks"
                )
                vals, ranks = src
                out[r][ooff : ooff + cnt] = vals
            if post:
                old = staging[r][post % 2]
                assert old is None or old[3], (
                    f"rank {r} overwrites slot {post % 2} only after its right read it"
                )
                staging[r][post % 2] = (post, vals, ranks, False)
    want = {
        "allreduce": lambda r: sum(inp),
        "reduce_scatter": lambda r: sum(x[r * count : (r + 1) * count] for x in inp),
        "allgather": lambda r: np.concatenate(inp),
    }[coll]
    if n == 1 or count == 0:
        assert all(p == [] for p in plans)
    else:
        for r in range(n):
            assert np.array_equal(out[r], want(r)), f"rank {r}"
    return plans, finished


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("count,slot", [(0, 4), (1, 4), (5, 1), (13, 4), (40, 5), (1027, 64)])
def test_ipc_ring_allreduce_plan_sums_every_block_once_on_every_rank(n, count, slot):
    plans, finished = _simulate_ipc_ring("allreduce", n, count, slot)
    if not plans[0]:
        return
    rounds = -(-count // (slot * n))
    assert all(len(p) == rounds * (2 * n - 1) for p in plans)
    assert all(sum(1 for s in p if s[6]) == rounds * 2 * (n - 1) for p in plans), "2 (n - 1) posts a round"
    assert len(finished) == rounds * n and sum(c for _, _, c in finished) == count, "each block finished once"
    posts = [s[6] for s in plans[0] if s[6]]
    assert posts == list(range(1, len(posts) + 1)), "epochs count up from 1 without gaps"


@pytest.mark.parametrize("coll", ["reduce_scatter", "allgather"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("count,slot", [(0, 4), (1, 4), (5, 1), (13, 4), (1027, 64)])
def test_ipc_ring_reduce_scatter_and_allgather_plans(coll, n, count, slot):
    plans, finished = _simulate_ipc_ring(coll, n, count, slot)
    if not plans[0]:
        return
    windows = -(-count // slot)
    assert all(len(p) == windows * n and sum(1 for s in p if s[6]) == windows * (n - 1) for p in plans)
    if coll == "reduce_scatter":
        assert sorted(r for r, _, _ in finished) == sorted(list(range(n)) * windows), (
            "each rank finishes its block"
        )


def test_ipc_ring_plan_rejects_bad_arguments():
    for args in (
        ("allreduce", 3, 3, 10, 4),
        ("allreduce", 0, 0, 10, 4),
        ("allreduce", 0, 2, 10, 0),
        ("allreduce", 0, 2, -1, 4),
        ("broadcast", 0, 2, 10, 4),
    ):
        with pytest.raises(plait.InvalidArgument):
            _C.gpu_plan_ipc_ring(*args)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16])
def test_tree_links(n):
    links = [_C.gpu_plan_tree(r, n) for r in range(n)]
    assert links[0][0] == -1
    for r, (_parent, children) in enumerate(links):
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
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "version": 3,
            "stream": stream,
        }


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
        (3 << 40) + 256,
        4 * 6 * 8,
        8,
        24,
        3,
        "int64",
        7,
    )
    assert g.describe().endswith("int64 x 24 on GPU 3")
    for typestr, name in (
        ("<f2", "float16"),
        ("<f8", "float64"),
        ("|i1", "int8"),
        ("|u1", "uint8"),
        ("<i4", "int32"),
        ("|b1", "bool"),
        ("<c8", None),
    ):
        assert _arrays.gpu_array(FakeCuda(typestr=typestr), "x", lambda p: 0).dtype == name
    with pytest.raises(plait.InvalidArgument, match="C-contiguous"):
        _arrays.gpu_array(FakeCuda((4, 6), strides=(4, 16)), "input", lambda p: 0)
    with pytest.raises(plait.InvalidArgument, match="only DLPack"):
        _arrays.gpu_array(FakeDlpack(), "input", lambda p: 0)


# -- refusing what cannot run, on every rank ---------------------------------------------------
# Cases that pretend to be a CUDA build with two devices, so the checks after "no device" run.
FAKE_BUILD = (
    "wrong_device",
    "bad_dtype_override",
    "broadcast_wrong_device",
    "reduce_host_output",
    "alltoall_bad_dtype",
    "send_recv_tag",
)


def _refused(rank, n, store, case):
    import plait as p
    from plait import _cuda as cu

    comm = p.init(rank, n, store=store)
    if case in FAKE_BUILD:
        # Pretend to be a CUDA build with two devices: the device check must come first.
        cu.compiled = lambda: True
        cu.device_count = lambda: 2
        p._C.cuda_pointer_device = lambda ptr: ptr >> 40
    x = np.arange(8, dtype=np.float32)
    calls = {
        "gpu_input": lambda: comm.allreduce(FakeCuda() if rank == 0 else x),
        "mixed": lambda: comm.allreduce(FakeCuda(), out=np.zeros(8, np.float32)),
        "dlpack_only": lambda: comm.allreduce(FakeDlpack(), out=FakeDlpack()),
        "broadcast": lambda: comm.broadcast(FakeCuda(), 1),
        "reduce": lambda: comm.reduce(FakeCuda(), 1, op="max"),
        "alltoall": lambda: comm.alltoall(FakeCuda()),
        "send_recv": lambda: comm.send(FakeCuda(), 1) if rank == 0 else comm.recv(FakeCuda(), 0),
        "broadcast_wrong_device": lambda: comm.broadcast(FakeCuda(ptr=1 << 40), 0, out=FakeCuda(ptr=2 << 40)),
        "reduce_host_output": lambda: (
            comm.reduce(FakeCuda(ptr=1 << 40), 0, out=np.zeros(8, np.float32))
            if rank == 0
            else comm.reduce(x, 0)
        ),
        "alltoall_bad_dtype": lambda: comm.alltoall(
            FakeCuda(ptr=1 << 40), out=FakeCuda(ptr=1 << 40), dtype="int64"
        ),
        "send_recv_tag": lambda: (
            comm.send(FakeCuda(ptr=1 << 40), 1, tag=3)
            if rank == 0
            else comm.recv(FakeCuda(ptr=1 << 40), 0, tag=3)
        ),
        "wrong_device": lambda: comm.allreduce(FakeCuda(ptr=1 << 40), out=FakeCuda(ptr=2 << 40)),
        "bad_dtype_override": lambda: comm.allreduce(
            FakeCuda(ptr=1 << 40), out=FakeCuda(ptr=1 << 40), dtype="bfloat16"
        ),
    }
    try:
        calls[case]()
    except p.PlaitError as e:
        return type(e).__name__, str(e)
    return None, "no error"


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("gpu_input", None),
        ("mixed", r"output is a host array \(ndarray\) and the other a GPU array"),
        ("dlpack_only", r"offers only DLPack"),
        ("broadcast", None),
        ("reduce", None),
        ("alltoall", None),
        ("send_recv", None),
        ("broadcast_wrong_device", r"broadcast.*input on GPU 1, output on GPU 2"),
        (
            "reduce_host_output",
            r"rank 0: reduce.*output is a host array \(ndarray\) and the other a GPU array",
        ),
        ("alltoall_bad_dtype", r"alltoall.*dtype='int64' needs 8-byte elements, the arrays have 4 and 4"),
        ("send_recv_tag", r"(send|recv).*tag 3: GPU send/recv run over NCCL, which has no tags"),
        ("wrong_device", r"input on GPU 1, output on GPU 2"),
        ("bad_dtype_override", r"dtype='bfloat16' needs 2-byte elements, the arrays have 4 and 4"),
    ],
)
def test_gpu_input_that_cannot_run_fails_on_every_rank(case, pattern):
    if pattern is None:  # every GPU collective, refused on this machine before any GPU work
        pattern = (
            r"no CUDA device is visible"
            if _cuda.compiled() and _cuda.device_count() == 0
            else r"no CUDA path"
            if not _cuda.compiled()
            else None
        )
        if pattern is None:
            pytest.skip("this machine has a CUDA device: the GPU input would run")
    results = run_ranks(_refused, 2, RUN_TIMEOUT, args=(case,))
    for rank, (cls, msg) in enumerate(results):
        assert cls == "InvalidArgument", f"rank {rank}: {cls}: {msg}"
        who = (
            "rank 0" if case in ("gpu_input", "reduce_host_output") else "rank "
        )  # elsewhere every rank fails alike
        assert who in msg, f"rank {rank}: the message names the rank that failed: {msg}"
        assert __import__("re").search(pattern, msg), f"rank {rank}: {msg}"
    if case == "gpu_input":
        assert "allreduce" in results[1][1] and "float32 x 8" in results[1][1]
    if case in ("broadcast", "reduce", "alltoall"):
        assert all(case in msg for _, msg in results)
    if case == "send_recv":
        assert all("send" in msg or "recv" in msg for _, msg in results)  # a rank may report its peer's abort


def _p2p_first(rank, n, store):
    import plait as p
    from plait import _cuda as cu

    comm = p.init(rank, n, store=store)
    cu.compiled = lambda: True
    cu.device_count = lambda: 1
    p._C.cuda_pointer_device = lambda ptr: 0
    try:
        if rank == 0:
            comm.send(FakeCuda(ptr=1 << 20), 1)
        elif rank == 1:
            comm.recv(FakeCuda(ptr=1 << 20), 0)
    except p.PlaitError as e:
        out = (type(e).__name__, str(e))
    else:
        out = (None, "no error")
    comm.barrier(timeout=30)  # rank 2 was not drawn in, and the CPU communicator still works
    return out


def test_gpu_send_recv_first_in_a_larger_world_says_why():
    """Creating the GPU communicator is a collective: send/recv of 2 of 3 ranks cannot do it."""
    results = run_ranks(_p2p_first, 3, RUN_TIMEOUT)
    for rank in (0, 1):
        cls, msg = results[rank]
        assert (
            cls == "InvalidArgument"
            and "first GPU call of a communicator of 3 ranks must be a collective" in msg
        ), msg
    assert results[2] == (None, "no error")


def _gpu_comm_rank(rank, n, store):
    import plait as p

    comm = p.init(rank, n, store=store)
    errs = []
    for r, s in ((-1, 2), (2, 2), (0, 0), (3, -1), (-1, 5)):
        try:
            _C.nccl_queue(comm._c, bytes(128), 0, 1.0, 4096, "", "", rank=r, size=s)
            errs.append("no error")
        except p.InvalidArgument as e:
            errs.append(str(e))
    comm.finalize()
    return errs


@pytest.mark.skipif(not _cuda.compiled(), reason="CPU-only build")
def test_gpu_communicator_rank_override_is_checked_before_nccl():
    """A HierCommunicator passes its global rank/size with the host-local CPU communicator."""
    (errs,) = run_ranks(_gpu_comm_rank, 1, RUN_TIMEOUT)
    for (r, s), msg in zip(((-1, 2), (2, 2), (0, 0), (3, -1), (-1, 5)), errs):
        assert f"rank {r} of size {s}: need 0 <= rank < size" in msg, msg


def test_torch_backend_is_registered_for_cuda_too():
    dist = pytest.importorskip("torch.distributed")
    import plait.torch  # noqa: F401 - registers the backend

    # both backends take CUDA tensors (the native one through the C API's device buffers)
    assert set(dist.Backend.backend_capability["plait"]) == {"cpu", "cuda"}


def test_bench_device_cuda_says_why_it_cannot_run():
    if plait.cuda_available():
        pytest.skip("this machine has a CUDA device: tests/gpu/run.sh runs the GPU bench")
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "plait.bench", "--device", "cuda", "-n", "1", "-b", "1K", "-e", "1K"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "no CUDA device is visible" in r.stderr or "no CUDA path" in r.stderr, r.stderr


# -- GPU calls are compared across ranks ---------------------------------------------------
# These drive the communicator's real GPU call path (validate -> select -> check -> enqueue, in
# C++) on a recording queue: _C._FakeGpuQueue offers the capabilities of the transport it stands
# in for and records what it would have enqueued. Only the GPU rows of a CUDA build exist to be
# selected, so a CPU-only build has nothing to run them on.
needs_gpu_rows = pytest.mark.skipif(
    not _cuda.compiled(), reason="the GPU algorithm rows are compiled into CUDA builds only"
)


class _Recorded:
    """What a fake queue was handed, as collective names (`calls`) and full records."""

    def __init__(self, q):
        self.q = q

    @property
    def calls(self):
        return [r[0] for r in self.q.records()]

    def records(self):
        return self.q.records()


def _fake_gpu(rank, n, store, algo_override="", transport="nccl"):
    """A rank's communicator on a pretend CUDA build with one device, whose GPU queue (attached
    as the first GPU call would attach the real one) records instead of enqueueing."""
    import plait as p
    from plait import _cuda as cu

    comm = p.init(rank, n, store=store, timeout=30)
    cu.compiled = lambda: True
    cu.device_count = lambda: 1
    p._C.cuda_pointer_device = lambda ptr: 0
    q = p._C._FakeGpuQueue(comm._c, 0, transport, 30.0, algo_override)
    p._C.gpu_attach(comm._c, q)
    comm._gpu = q
    return p, comm, _Recorded(q)


def _gpu_mismatch(rank, n, store, field):
    p, comm, fake = _fake_gpu(rank, n, store)
    odd = rank == n - 1
    x, y = FakeCuda(ptr=1 << 20), FakeCuda(ptr=2 << 20)
    try:
        comm.allreduce(x, out=y)  # every rank agrees
        if field == "count":
            shape = (7,) if odd else (8,)
            comm.allreduce(FakeCuda(shape, ptr=1 << 20), out=FakeCuda(shape, ptr=2 << 20))
        elif field == "op":
            comm.allreduce(x, out=y, op="max" if odd else "sum")
        elif field == "root":
            comm.broadcast(x, 1 if odd else 0)
        else:  # collective
            comm.broadcast(x, 0) if odd else comm.allreduce(x, out=y)
        # The check never waits: a rank that published first learns of the mismatch from the
        # rank that found it, at its next call (its GPU watchdog would abort the enqueued work).
        comm.barrier()
    except p.PlaitError as e:
        return type(e).__name__, str(e), fake.calls
    return None, "no error", fake.calls


@needs_gpu_rows
@pytest.mark.parametrize("field", ("count", "op", "root", "collective"))
def test_mismatched_gpu_calls_raise_mismatch_on_every_rank(field):
    results = run_ranks(_gpu_mismatch, 3, RUN_TIMEOUT, args=(field,))
    for rank, (cls, msg, calls) in enumerate(results):
        assert cls == "MismatchError" and "mismatched GPU calls" in msg, (rank, msg)
        assert field in msg.split("disagree on", 1)[1].split(" at ", 1)[0], (rank, msg)
        # Ranks are not held in lock-step: a slow rank may get the abort before its first call.
        assert calls[:1] in ([], ["allreduce"]) and len(calls) <= 2, (rank, calls)
    # Whoever found the mismatch raised before enqueueing the call it found wrong.
    assert any(calls == ["allreduce"] for _, _, calls in results), results


@needs_gpu_rows
def test_gpu_calls_fingerprint_the_algorithm_that_runs():
    """'auto' and the name it resolves to agree; ranks whose 'auto' resolves differently (e.g.
    PLAIT_GPU_ALGO set on one rank only) raise MismatchError instead of hanging."""
    for case, want in (("auto_vs_name", None), ("env_differs", "MismatchError")):
        results = run_ranks(_resolved_algo, 2, RUN_TIMEOUT, args=(case,))
        for rank, (cls, msg, calls) in enumerate(results):
            assert cls == want, (case, rank, msg)
            if want:
                assert "algorithm" in msg and len(calls) <= 1, (rank, msg, calls)
            else:
                assert calls == ["allreduce"], (rank, calls)
        if want:  # the rank that found it never enqueued the call
            assert any(calls == [] for _, _, calls in results), results


def _runs_ahead(rank, n, store):
    # Rank 0 makes 100 GPU calls while rank 1 makes none; with a host rendezvous per call it could
    # not finish one. Rank 1 joins only once rank 0 says it is done, then makes the same calls.
    from plait._store import Store

    p, comm, fake = _fake_gpu(rank, n, store)
    s = Store(*store, timeout=30)
    x, y = FakeCuda(ptr=1 << 20), FakeCuda(ptr=2 << 20)
    if rank == 1:
        s.get("rank0 done", timeout=20)
    for _ in range(100):
        comm.allreduce(x, out=y)  # enqueued on the (fake) stream: returns without waiting
    if rank == 0:
        s.set("rank0 done", b"1")
    comm.barrier()
    return len(fake.calls)


@needs_gpu_rows
def test_gpu_call_check_does_not_wait_for_peers():
    assert run_ranks(_runs_ahead, 2, RUN_TIMEOUT) == [100, 100]


def _late_mismatch(rank, n, store, at):
    p, comm, fake = _fake_gpu(rank, n, store)
    x, y = FakeCuda(ptr=1 << 20), FakeCuda(ptr=2 << 20)
    try:
        for i in range(1, 301):  # several laps of the 64-slot ring of call prints
            op = "max" if (i == at and rank == n - 1) else "sum"
            comm.allreduce(x, out=y, op=op)
            if i % 50 == 0:
                comm.barrier()  # keeps ranks within a lap, as a training loop's host work does
        comm.barrier()
    except p.MismatchError as e:
        return str(e), len(fake.calls)
    return None, len(fake.calls)


@needs_gpu_rows
@pytest.mark.parametrize("at", [0, 150])
def test_gpu_call_check_over_many_laps_of_its_ring(at):
    results = run_ranks(_late_mismatch, 3, RUN_TIMEOUT, args=(at,))
    if not at:
        assert results == [(None, 300)] * 3
        return
    for rank, (msg, ncalls) in enumerate(results):
        assert msg and f"GPU call #{at} " in msg and "op" in msg, (rank, msg)
        assert ncalls <= at, (rank, ncalls)  # nobody got past the mismatched call
    assert any(ncalls == at - 1 for _, ncalls in results)


def _gpu_calls_recorded(rank, n, store):
    p, comm, fake = _fake_gpu(rank, n, store)
    x, y = FakeCuda(ptr=1 << 20), FakeCuda(ptr=2 << 20)
    comm.allreduce(x, out=y)
    comm.broadcast(x, 1)
    comm.barrier()
    mine = [c for c in p.dump(comm)["ranks"][rank]["calls"] if c["transport"] != "shm"]
    if rank == 1:
        comm.allreduce(x, out=y)  # then never joins the barrier below
        time.sleep(4)
        return mine, None
    try:
        comm.barrier(timeout=1)
    except p.TimeoutError as e:
        return mine, str(e)
    return mine, "no error"


@needs_gpu_rows
def test_gpu_calls_are_in_the_flight_recorder():
    # GPU calls are kept as issued (transport, algorithm, "enqueued"), so a survivor's report says
    # what a peer last handed its GPU, next to its host calls.
    results = run_ranks(_gpu_calls_recorded, 2, RUN_TIMEOUT)
    for mine, _ in results:
        assert [
            (c["collective"], c["call"], c["count"], c["root"], c["state"], c["transport"]) for c in mine
        ] == [
            ("allreduce", 1, 8, -1, "enqueued", "nccl"),
            ("broadcast", 2, 8, 1, "enqueued", "nccl"),
        ], mine
        assert all(c["algorithm"] == "nccl" and c["dtype"] == "float32" for c in mine), mine
    msg = results[0][1]
    assert "rank 1 last entered allreduce (GPU) #3 (float32, 8, nccl over nccl)" in msg, msg
    assert "enqueued it on its GPU stream" in msg, msg


def _resolved_algo(rank, n, store, case):
    # PLAIT_GPU_ALGO=ring on rank 1 only: its "auto" resolves to ring, rank 0's to nccl.
    p, comm, fake = _fake_gpu(rank, n, store, "ring" if case == "env_differs" and rank == 1 else "")
    algo = "nccl" if case == "auto_vs_name" and rank == 0 else None
    try:
        comm.allreduce(FakeCuda(ptr=1 << 20), out=FakeCuda(ptr=2 << 20), algorithm=algo)
        comm.barrier()  # the rank that published first hears of a mismatch here
    except p.PlaitError as e:
        return type(e).__name__, str(e), fake.calls
    return None, "no error", fake.calls


# -- one call path for host and GPU buffers ---------------------------------------------------
def _gpu_path(rank, n, store, case):
    p, comm, fake = _fake_gpu(rank, n, store, transport="ipc" if case == "ipc_broadcast" else "nccl")
    x = FakeCuda((4 * n,), ptr=1 << 20, stream=7)
    y = FakeCuda((4 * n,), ptr=2 << 20, stream=7)
    calls = {
        # sizes only the C++ validator checks: a wrong allgather output on rank 0
        "allgather_size": lambda: comm.allgather(
            FakeCuda((4,), ptr=1 << 20), out=FakeCuda((4 * n + (rank == 0),), ptr=2 << 20)
        ),
        "alltoall_in_place": lambda: comm.alltoall(x, out=x),
        "ipc_broadcast": lambda: comm.broadcast(x, 0),
        "unknown_algorithm": lambda: comm.allreduce(x, out=y, algorithm="ring" if rank else "nope"),
        # review 2, finding 6: a misaligned device view would fault the kernel (a sticky error)
        "misaligned": lambda: comm.allreduce(
            FakeCuda((4 * n,), ptr=(1 << 20) + 2 * (rank == 1), stream=7), out=y
        ),
    }
    try:
        calls[case]()
        comm.barrier()  # a rank that enqueued before the abort raises here
    except p.PlaitError as e:
        return type(e).__name__, str(e), fake.calls
    return None, "no error", fake.calls


@needs_gpu_rows
@pytest.mark.parametrize(
    "case,pattern",
    [
        ("allgather_size", "output has 36 bytes but must be 2 x the input's 16"),
        ("alltoall_in_place", "alltoall cannot run in place on a GPU"),
        ("ipc_broadcast", "no path over the CUDA IPC transport"),
        ("unknown_algorithm", "has no algorithm 'nope' (choose auto, nccl, ring, tree) over NCCL"),
        ("misaligned", "input at address 0x100002 is not aligned to its 4-byte float32 elements"),
    ],
)
def test_gpu_call_path_refuses_bad_calls_on_every_rank(case, pattern):
    """GPU buffers go through the communicator's one validator and selector (C++): a call one rank
    rejects raises on every rank, and the rank that rejected it enqueued nothing."""
    results = run_ranks(_gpu_path, 2, RUN_TIMEOUT, args=(case,))
    for rank, (cls, msg, calls) in enumerate(results):
        assert cls == "InvalidArgument", (rank, cls, msg)
        assert len(calls) <= 1, (rank, calls)
    assert any(pattern in msg and not calls for _, msg, calls in results), results


def _gpu_records(rank, n, store):
    p, comm, fake = _fake_gpu(rank, n, store)
    x, y = FakeCuda((6 * n,), ptr=1 << 20, stream=5), FakeCuda((6 * n,), ptr=2 << 20, stream=5)
    comm.allreduce(x, out=y, algorithm="ring")
    comm.alltoall(x, out=y)
    comm.reduce_scatter(x, out=FakeCuda((6,), ptr=3 << 20, stream=5))
    comm.allgather(FakeCuda((6,), ptr=3 << 20, stream=5), out=y)
    comm.broadcast(x, 1)
    comm.barrier()
    return fake.records()


@needs_gpu_rows
def test_gpu_calls_reach_the_queue_selected_and_counted_as_host_calls_are():
    for records in run_ranks(_gpu_records, 3, RUN_TIMEOUT):
        assert records == [
            ("allreduce", "ring", 18, 5),
            ("alltoall", "nccl", 6, 5),  # per peer, as CallArgs counts alltoall everywhere
            ("reduce_scatter", "nccl", 6, 5),
            ("allgather", "nccl", 6, 5),
            ("broadcast", "nccl", 18, 5),
        ], records


def _attach_twice(rank, n, store):
    p, comm, fake = _fake_gpu(rank, n, store)
    try:
        p._C.gpu_attach(comm._c, p._C._FakeGpuQueue(comm._c, 0))
    except p.InvalidArgument as e:
        return str(e)
    return "no error"


def test_a_communicator_takes_one_gpu_queue():
    (msg,) = run_ranks(_attach_twice, 1, RUN_TIMEOUT)
    assert "already has a GPU transport (nccl on GPU 0)" in msg, msg


@needs_gpu_rows
@pytest.mark.parametrize(
    "override,coll,algo,want",
    [
        ("", "allreduce", "auto", "nccl"),
        ("ring", "allreduce", "auto", "ring"),
        ("ring", "broadcast", "auto", "nccl"),  # a blanket override keeps auto where it has no row
        ("allreduce=tree", "allreduce", "", "tree"),
        ("allreduce=tree", "allgather", "auto", "nccl"),
        ("allreduce=tree", "allreduce", "ring", "ring"),  # a name asked for wins
        ("allgather=nope", "allgather", "auto", None),
    ],
)
def test_gpu_algorithm_override_resolves_by_name(override, coll, algo, want):
    (got,) = run_ranks(_resolve_with, 1, RUN_TIMEOUT, args=(override, coll, algo))
    if want is None:
        assert got[0] == "InvalidArgument" and "has no algorithm 'nope'" in got[1], got
    else:
        assert got == want
    (ipc,) = run_ranks(_resolve_with, 1, RUN_TIMEOUT, args=(override, "allreduce", "auto", "ipc"))
    assert ipc == "one_shot", ipc  # PLAIT_GPU_ALGO is NCCL's; IPC rows go by name or auto


def _resolve_with(rank, n, store, override, coll, algo, transport="nccl"):
    comm = plait.init(rank, n, store=store, timeout=30)
    q = _C._FakeGpuQueue(comm._c, 0, transport, 30.0, override)
    try:
        return q.resolve(coll, algo)
    except plait.PlaitError as e:
        return type(e).__name__, str(e)


# -- two_shot's part boundaries ----------------------------------------------------------------
@pytest.mark.parametrize("count", [0, 1, 7, 8, 100, 1027, 4096, 5000])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("align", [1, 2, 4, 8, 16])
def test_aligned_parts_cover_the_window_and_start_aligned(count, n, align):
    b = _C.gpu_plan_parts(count, n, align)
    assert len(b) == n + 1 and b[0] == 0 and b[-1] == count
    assert all(lo <= hi for lo, hi in zip(b, b[1:])), "contiguous, in order"
    assert all(x % align == 0 or x == count for x in b), "every part begins aligned (or is empty at the end)"
    assert all(abs(x - count * q // n) < align for q, x in enumerate(b)), (
        "at most align - 1 from an even split"
    )
    with pytest.raises(plait.InvalidArgument):
        _C.gpu_plan_parts(count, n, 0)


def test_gpu_wait_timeouts_are_clamped():
    assert _C.gpu_timeout_ns(2.0) == 2_000_000_000 and _C.gpu_timeout_ns(1e-9) == 1
    for bad in (0.0, -1.0, float("nan"), float("-inf")):
        assert _C.gpu_timeout_ns(bad) == 0
    for huge in (float("inf"), 1e300, 2.0**62):
        assert _C.gpu_timeout_ns(huge) == 1 << 62


# -- the GPU watchdog, with fake events ----------------------------------------------------------
def _until(cond, limit=20.0):
    """Polls cond() until true; the limit only keeps a broken watchdog from hanging the test."""
    import time

    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, "the watchdog did not act"
        time.sleep(0.005)


def test_watchdog_forgets_finished_calls_and_recycles_their_events():
    p = _C._WatchdogProbe(None)
    for i in range(50):
        start, end = p.issue(0.05, f"call {i}")
        p.set(start, 1)
        p.set(end, 1)
        assert p.drain(20.0)
    assert p.in_flight() == 0 and p.aborts() == [] and not p.fired()
    assert p.events() == 2, "one call at a time in flight: its two events are reused"


def test_watchdog_deadline_runs_from_when_the_call_started():
    import time

    p = _C._WatchdogProbe(None)
    start, _ = p.issue(0.2, "allreduce (ring, float32, count 8)")
    time.sleep(0.6)  # queued behind other work on the stream: not started, so not late
    assert p.aborts() == [] and p.in_flight() == 1
    p.set(start, 1)
    _until(p.fired)
    (msg,) = p.aborts()
    assert msg.startswith(
        "timeout: allreduce (ring, float32, count 8): did not finish within its deadline (0.2 s"
    ), msg
    # A dead communicator watches nothing more.
    p.issue(0.1, "later")
    assert p.in_flight() == 0 and len(p.aborts()) == 1


def test_watchdog_reports_the_communicators_error_once():
    p = _C._WatchdogProbe(None)
    p.issue(300, "allgather (nccl, int8, count 3)")
    p.set_poll_error("NCCL reported an error for work in flight: remote process exited")
    _until(p.fired)
    assert p.aborts() == ["generic: NCCL reported an error for work in flight: remote process exited"]


def test_watchdog_reads_the_error_word_after_the_last_call_ran():
    """An IPC kernel that gave up finishes its call normally: the error is polled after the drain."""
    p = _C._WatchdogProbe(None)
    start, end = p.issue(300, "allreduce (one_shot, float16, count 5)")
    p.set_poll_error("a peer did not reach the same step within the deadline (the waiting kernel gave up)")
    p.set(start, 1)
    p.set(end, 1)
    _until(p.fired)
    assert "waiting kernel gave up" in p.aborts()[0]


def test_watchdog_reports_a_failed_gpu_event():
    p = _C._WatchdogProbe(None)
    start, end = p.issue(300, "reduce_scatter (ring, int32, count 9)")
    p.set(start, 1)
    p.set(end, -1)
    _until(p.fired)
    (msg,) = p.aborts()
    assert msg.startswith(
        "generic: reduce_scatter (ring, int32, count 9): the GPU reported an error for this call's "
        "work (cudaErrorLaunchFailure;"
    ), msg  # review 2, finding 13: the CUDA error is named


def test_watchdog_is_idle_without_calls():
    import time

    p = _C._WatchdogProbe(None)
    time.sleep(0.2)
    assert p.polls() == 0, "no call in flight: the thread sleeps"
    start, end = p.issue(300, "x")
    _until(lambda: p.polls() > 3)
    p.set(start, 1)
    p.set(end, 1)
    assert p.drain(20.0)
    polled = p.polls()
    time.sleep(0.2)
    assert p.polls() == polled, "drained: the thread sleeps again"


def _watchdog_ranks(rank, n, store, case):
    import os

    import plait as p

    comm = p.init(rank, n, store=store, timeout=60)
    probe = p._C._WatchdogProbe(comm._c)
    if case == "deadline":
        if rank == 0:  # its call never finishes: the watchdog aborts it for every rank
            start, _ = probe.issue(0.3, "allreduce (nccl, float32, count 4)")
            probe.set(start, 1)
            _until(probe.fired)
            return probe.aborts()
        probe.issue(300, "allreduce (nccl, float32, count 4)")  # waits for rank 0, which gave up
        _until(probe.fired)
        try:
            comm.barrier(timeout=30)
        except p.PlaitError as e:
            return probe.aborts() + [type(e).__name__ + ": " + str(e)]
        return probe.aborts() + ["no error"]
    # case == "died": rank 1 dies while rank 0's GPU call waits for it
    if rank == 1:
        comm.barrier(timeout=30)
        os._exit(3)
    comm.barrier(timeout=30)
    probe.issue(300, "allreduce (ring, float32, count 4)")
    _until(probe.fired)
    return probe.aborts()


def test_watchdog_deadline_reaches_every_rank():
    first, second = run_ranks(_watchdog_ranks, 2, RUN_TIMEOUT, args=("deadline",))
    assert len(first) == 1 and first[0].startswith(
        "timeout: allreduce (nccl, float32, count 4): did not finish"
    ), first
    assert (
        second[0].startswith("timeout: another rank aborted the communicator:")
        and "did not finish" in second[0]
    ), second
    assert second[1].startswith("TimeoutError") and "did not finish within its deadline" in second[1], second


def test_watchdog_sees_a_peer_die():
    first, _ = run_ranks(_watchdog_ranks, 2, RUN_TIMEOUT, args=("died",), may_die=(1,))
    assert len(first) == 1 and first[0].startswith("peer_lost: rank 1 (pid ") and "died" in first[0], first


# -- torch tensors on the GPU path (the Works themselves: tests/test_torch_cuda.py) ----------------
def test_torch_calls_record_their_tensors_on_the_stream(monkeypatch):
    """P7, review 2 finding 7: a GPU call tells torch's caching allocator that its tensors are in
    use on the call's stream, the default stream included (never for cupy arrays)."""
    torch = pytest.importorskip("torch")
    from plait import _gpu

    streams = {0: "stream of GPU 0", 1: "stream of GPU 1"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[device])

    class _Owner:
        def __init__(self):
            self.recorded = []

        def record_stream(self, s):
            self.recorded.append(s)

    t, c = _Owner(), _Owner()
    torch_arr = _arrays.GpuArray(1 << 20, 64, 4, 1, "float32", 77, t, "torch")
    cupy_arr = _arrays.GpuArray(2 << 20, 64, 4, 1, "float32", 77, c, "cupy")
    _gpu._record_streams(torch_arr, None, cupy_arr)
    assert t.recorded == ["stream of GPU 1"] and c.recorded == []
    default = _arrays.GpuArray(1 << 20, 64, 4, 0, "float32", 0, t, "torch")
    _gpu._record_streams(default)
    assert t.recorded == ["stream of GPU 1", "stream of GPU 0"], "the default stream too"


def _recorded_streams(rank, n, store):
    p, comm, fake = _fake_gpu(rank, n, store)
    seen = []
    p._arrays.GpuArray.record_stream = lambda self: seen.append((self.ptr, self.stream))
    x, y = FakeCuda(ptr=1 << 20, stream=0), FakeCuda(ptr=2 << 20, stream=0)
    comm.allreduce(x, out=y)  # the default stream
    h = comm.allreduce(x, out=FakeCuda(ptr=3 << 20, stream=9), async_op=True)
    comm.barrier()
    return seen, fake.records(), type(h).__name__


@needs_gpu_rows
def test_sync_async_and_default_stream_calls_record_their_arrays():
    """Review 2, finding 7: an async call's arrays are recorded too (a handle dropped after
    block() keeps nothing alive), and so are a default-stream call's."""
    (seen, records, handle), _ = run_ranks(_recorded_streams, 2, RUN_TIMEOUT)
    assert seen == [(1 << 20, 0), (2 << 20, 0), (1 << 20, 0), (3 << 20, 9)], seen
    assert [r[0] for r in records] == ["allreduce", "allreduce"] and handle == "GpuHandle"


def _queue_fails_on_one_rank(rank, n, store, case):
    """Every rank creates the NCCL queue, which waits in ncclCommInitRankConfig for all of them
    (here: a barrier standing for it); rank 1 fails before it joins."""
    import time

    import plait as p
    from plait import _gpu

    comm = p.init(rank, n, store=store, timeout=60)
    p._C.nccl_unique_id = lambda path: bytes(range(128))
    p._cuda.nccl_path = lambda: "libnccl.so.2"

    def queue(cpu, uid, device, t, chunk, algo, path, **kw):
        if rank == 1 and case == "queue":
            raise p.PlaitError("rank 1: cudaMalloc of 8388608 bytes of scratch: out of memory")
        comm.barrier(timeout=30)  # init is a collective of every rank
        return "queue"

    p._C.nccl_queue = queue
    if rank == 1 and case == "chunk":
        os.environ["PLAIT_GPU_CHUNK_BYTES"] = "4M"
    t0 = time.monotonic()
    try:
        _gpu._nccl_queue(comm, 0, 30.0, f"rank {rank}: allreduce (torch float32 x 4 on GPU 0)")
    except p.PlaitError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "no error", time.monotonic() - t0


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("queue", "creating the NCCL communicator: rank 1: cudaMalloc"),
        ("chunk", "PLAIT_GPU_CHUNK_BYTES='4M'"),
    ],
)
def test_a_gpu_queue_that_fails_on_one_rank_fails_on_every_rank_at_once(case, pattern):
    """Review 2, finding 5: peers waiting in NCCL's init learn of the failure at once, instead of
    waiting out their whole deadline and calling it a timeout."""
    results = run_ranks(_queue_fails_on_one_rank, 2, RUN_TIMEOUT, args=(case,))
    for rank, (cls, msg, took) in enumerate(results):
        # rank 1 raises its own error; rank 0 that error, or the abort that carries it
        allowed = ("InvalidArgument",) if rank == 1 else ("InvalidArgument", "PlaitError")
        assert cls in allowed and pattern in msg, (rank, cls, msg)
        assert took < 15, f"rank {rank} waited {took:.1f} s"


def test_gpu_handle_block_makes_the_stream_wait():
    from plait import _gpu

    class _Event:
        def __init__(self):
            self.blocked = []

        def block(self, stream):
            self.blocked.append(stream)

        def wait(self, timeout):
            raise AssertionError("block() must not wait on the host")

    ev = _Event()
    h = _gpu.GpuHandle(ev, ("x", "out"), "result", 3)
    h.block(0xABC)
    assert ev.blocked == [0xABC] and h.device == 3


def test_gpu_queues_are_finalized_at_exit():
    """Review 2, finding 14: a script that never finalizes has its GPU queues finalized by atexit
    while the CUDA runtime is still loaded (their watchdogs stop polling); errors are swallowed."""
    from plait import _gpu

    class _Queue:
        def __init__(self, error=None):
            self.finalized, self.error = 0, error

        def finalize(self):
            self.finalized += 1
            if self.error:
                raise plait.PlaitError(self.error)

    class _Comm:
        pass

    comms = [_Comm() for _ in range(3)]
    for c, q in zip(comms, (_Queue(), _Queue("peer died"), None)):
        c._gpu = q
        _gpu._LIVE.add(c)
    _gpu._finalize_at_exit()
    assert [c._gpu.finalized for c in comms[:2]] == [1, 1]
    for c in comms:
        _gpu._LIVE.discard(c)
