"""GPU broadcast, reduce, alltoall and send/recv with exact values (NCCL: `nccl` is their one
algorithm): every dtype, every op for reduce, every root, counts 0/1/odd/multi-chunk/large, in
place and not, sync and async. NCCL world size 1 needs one GPU, 2-4 ranks a GPU each; over the
CUDA IPC transport (ranks sharing a GPU) these collectives are refused on every rank, and the
test proves the refusal is clear. Ranks are spawned, not forked (CUDA)."""

import pytest

from conftest import run_ranks
from gpu_util import DEVICES, DTYPES, RUN_TIMEOUT, Device, data, expected, ops_for, skip_reason

pytestmark = pytest.mark.cuda
COUNTS = (0, 1, 1027, 5000)
LARGE = 1 << 20  # float32 and int8 only: the other dtypes take the same code


def _counts(dtype):
    return COUNTS + ((LARGE,) if dtype in ("float32", "int8") else ())


def _block(dtype, src, dst, n, count):
    """What rank src sends rank dst (alltoall block, point-to-point message)."""
    return data(dtype, "sum", src + 2 * dst, n, count)


def _sweep(rank, n, store, colls):
    import numpy as np

    import plait

    dev = Device(rank)
    comm = plait.init(rank, n, store=store)
    bad, runs = [], 0

    def same(what, got, want):
        nonlocal runs
        runs += 1
        if got.shape != want.shape or not np.array_equal(got, want):
            bad.append(
                f"rank {rank}: {what}: got {got.reshape(-1)[:4]} (shape {got.shape}), "
                f"want {want.reshape(-1)[:4]} (shape {want.shape})"
            )

    for dtype in DTYPES:
        for count in _counts(dtype):
            async_op = count == 1027
            for in_place in (False, True):
                tail = f"{dtype}/count {count}/in_place {in_place}"
                if "broadcast" in colls:
                    for root in range(n):
                        x, dt = dev.put(data(dtype, "sum", rank, n, count))
                        out = x if in_place else dev.empty(x, count)
                        h = comm.broadcast(x, root, out=out, dtype=dt, async_op=async_op)
                        got = h.wait(timeout=120) if async_op else h
                        same(
                            f"broadcast/root {root}/{tail}",
                            dev.get(got, dtype),
                            data(dtype, "sum", root, n, count),
                        )
                if "reduce" in colls:
                    for op in ops_for(dtype):
                        for root in range(n):
                            x, dt = dev.put(data(dtype, op, rank, n, count))
                            out = (x if in_place else dev.empty(x, count)) if rank == root else None
                            h = comm.reduce(x, root, out=out, op=op, dtype=dt, async_op=async_op)
                            got = h.wait(timeout=120) if async_op else h
                            if rank == root:
                                same(
                                    f"reduce/{op}/root {root}/{tail}",
                                    dev.get(got, dtype),
                                    expected(dtype, op, n, count),
                                )
                            else:
                                same(
                                    f"reduce/{op}/root {root}/{tail}: a non-root's input is untouched",
                                    dev.get(x, dtype),
                                    data(dtype, op, rank, n, count),
                                )
                if "alltoall" in colls and not in_place:
                    x, dt = dev.put(np.concatenate([_block(dtype, rank, j, n, count) for j in range(n)]))
                    out = dev.empty(x, n * count)
                    h = comm.alltoall(x, out=out, dtype=dt, async_op=async_op)
                    got = h.wait(timeout=120) if async_op else h
                    want = np.concatenate([_block(dtype, j, rank, n, count) for j in range(n)])
                    same(f"alltoall/{tail}", dev.get(got, dtype), want)
                if "send_recv" in colls and not in_place and n > 1:
                    # Pairs (0, 1), (2, 3): two messages each way, matched in issue order (NCCL has
                    # no tags); the lower rank sends first so the two never both wait to send.
                    peer = rank ^ 1
                    if peer < n:
                        msg = [
                            _block(dtype, rank, peer, n, count)
                            if k == 0
                            else data(dtype, "sum", rank + 2 * peer + 5, n, count)
                            for k in range(2)
                        ]
                        bufs = [dev.put(m) for m in msg]
                        outs = [dev.empty(bufs[0][0], count) for _ in range(2)]
                        for step in (0, 1) if rank < peer else (1, 0):
                            for k in range(2):
                                if step == 0:
                                    comm.send(bufs[k][0], peer, dtype=bufs[k][1])
                                else:
                                    comm.recv(outs[k], peer, dtype=bufs[k][1])
                        wants = [
                            _block(dtype, peer, rank, n, count),
                            data(dtype, "sum", peer + 2 * rank + 5, n, count),
                        ]
                        for k in range(2):
                            same(f"send/recv message {k}/{tail}", dev.get(outs[k], dtype), wants[k])
    return runs, bad[:10]


def _check(results):
    assert sum(r for r, _ in results) > 0
    bad = [line for _, lines in results for line in lines]
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
@pytest.mark.parametrize("coll", ["broadcast", "reduce", "alltoall"])
def test_nccl_world_of_one(coll):
    _check(
        run_ranks(
            _sweep, 1, RUN_TIMEOUT, args=([coll],), env={"PLAIT_GPU_TRANSPORT": "nccl"}, start_method="spawn"
        )
    )


@pytest.mark.skipif(skip_reason(2) is not None, reason=str(skip_reason(2)))
@pytest.mark.parametrize("n", sorted({2, min(4, max(DEVICES, 2))}))
def test_nccl_one_gpu_per_rank(n):
    _check(
        run_ranks(
            _sweep,
            n,
            RUN_TIMEOUT,
            args=(["broadcast", "reduce", "alltoall", "send_recv"],),
            start_method="spawn",
        )
    )


def _refused(rank, n, store, case, one_gpu):
    import numpy as np

    import plait

    dev = Device(0 if one_gpu else rank)
    comm = plait.init(rank, n, store=store)
    x, _ = dev.put(np.ones(8, np.float32))
    calls = {
        "broadcast": lambda: comm.broadcast(x, 0),
        "reduce": lambda: comm.reduce(x, 0),
        "alltoall": lambda: comm.alltoall(dev.put(np.ones(8 * n, np.float32))[0]),
        "send_recv": lambda: comm.send(x, 1) if rank == 0 else comm.recv(x, 0),
        "send_self": lambda: comm.send(x, rank),
        "alltoall_in_place": lambda: (lambda y: comm.alltoall(y, out=y))(
            dev.put(np.ones(8 * n, np.float32))[0]
        ),
        "bad_root": lambda: comm.broadcast(x, n),
    }
    try:
        calls[case]()
        dev.get(x, "float32")
    except plait.PlaitError as e:
        return type(e).__name__, str(e)
    return None, "no error"


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
@pytest.mark.parametrize("case", ["broadcast", "reduce", "alltoall", "send_recv"])
def test_ipc_transport_refuses_them_on_every_rank(case):
    for rank, (cls, msg) in enumerate(
        run_ranks(_refused, 2, RUN_TIMEOUT, args=(case, True), start_method="spawn")
    ):
        assert cls == "InvalidArgument", f"rank {rank}: {cls}: {msg}"
        assert "no path over the CUDA IPC transport" in msg, f"rank {rank}: {msg}"


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
@pytest.mark.parametrize(
    "case,pattern",
    [
        ("send_self", r"peer 0 is not another rank of this 1-rank communicator"),
        ("alltoall_in_place", r"alltoall cannot run in place"),
        ("bad_root", r"root 1 is out of range for 1 ranks"),
    ],
)
def test_nccl_bad_calls_are_refused(case, pattern):
    import re

    ((cls, msg),) = run_ranks(
        _refused,
        1,
        RUN_TIMEOUT,
        args=(case, False),
        env={"PLAIT_GPU_TRANSPORT": "nccl"},
        start_method="spawn",
    )
    assert cls == "InvalidArgument" and re.search(pattern, msg), f"{cls}: {msg}"
