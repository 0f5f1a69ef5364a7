"""GPU arrays on a HierCommunicator (hosts simulated with PLAIT_HOST_ID): one flat NCCL
communicator of all ranks, exact values for every GPU collective over NCCL's and plait's
algorithms, host arrays on the same communicator around them, and the IPC transport refused.
NCCL needs a GPU per rank: 2 ranks on 2 hosts, or 4 ranks on 2 hosts with 4 GPUs. gloo (torch)
is the engine host arrays use between the hosts. Ranks are spawned, not forked (CUDA)."""

import importlib.util

import pytest

from conftest import run_ranks
from gpu_util import DEVICES, RUN_TIMEOUT, Device, data, expected, skip_reason

pytestmark = pytest.mark.cuda
N = 4 if DEVICES >= 4 else 2
_SKIP = skip_reason(2) or (None if importlib.util.find_spec("torch") else "needs torch (gloo between hosts)")


def _hier_sweep(rank, n, store, transport):
    import os

    import numpy as np

    import plait

    os.environ["PLAIT_HOST_ID"] = f"host{rank % 2}"  # interleaved: ranks of a host are not contiguous
    if transport:
        os.environ["PLAIT_GPU_TRANSPORT"] = transport
    dev = Device(rank)
    comm = plait.init(rank, n, store=store, timeout=60)
    assert isinstance(comm, plait.HierCommunicator), repr(comm)
    bad, runs = [], 0
    host = comm.allreduce(np.full(4, rank + 1, dtype=np.int64))  # host arrays before the GPU ones
    if host.tolist() != [n * (n + 1) // 2] * 4:
        bad.append(f"rank {rank}: host allreduce before: {host}")
    if transport == "ipc":
        try:
            comm.allreduce(dev.put(np.ones(8, np.float32))[0])
        except plait.InvalidArgument as e:
            return 0, [] if "reaches one host only" in str(e) else [f"rank {rank}: {e}"]
        return 0, [f"rank {rank}: PLAIT_GPU_TRANSPORT=ipc across hosts was not refused"]
    for algo in ("nccl", "ring", "tree"):
        for dtype, op in (("float32", "sum"), ("bfloat16", "avg"), ("int32", "max")):
            for count in (1, 1027):
                x, dt = dev.put(data(dtype, op, rank, n, count))
                got = comm.allreduce(x, op=op, algorithm=algo, dtype=dt)
                runs += 1
                if not np.array_equal(dev.get(got, dtype), expected(dtype, op, n, count)):
                    bad.append(f"rank {rank}: allreduce/{algo}/{dtype}/{op}/{count}")
                if algo == "tree":
                    continue
                blocks = np.concatenate([np.roll(data(dtype, op, rank, n, count), b) for b in range(n)])
                x, dt = dev.put(blocks)
                got = comm.reduce_scatter(x, op=op, algorithm=algo, dtype=dt, async_op=True).wait(timeout=60)
                runs += 1
                if not np.array_equal(dev.get(got, dtype), np.roll(expected(dtype, op, n, count), rank)):
                    bad.append(f"rank {rank}: reduce_scatter/{algo}/{dtype}/{op}/{count}")
                x, dt = dev.put(data(dtype, op, rank, n, count))
                got = comm.allgather(x, algorithm=algo, dtype=dt)
                runs += 1
                want = np.stack([data(dtype, op, r, n, count) for r in range(n)])
                if not np.array_equal(dev.get(got, dtype).reshape(n, count), want):
                    bad.append(f"rank {rank}: allgather/{algo}/{dtype}/{count}")
    host = comm.allgather(np.array([rank], dtype=np.int64))  # and after them
    if host.ravel().tolist() != list(range(n)):
        bad.append(f"rank {rank}: host allgather after: {host.ravel()}")
    comm.finalize()
    return runs, bad[:10]


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
def test_gpu_collectives_across_hosts_are_exact():
    results = run_ranks(_hier_sweep, N, RUN_TIMEOUT, args=("",), start_method="spawn")
    assert all(runs > 0 for runs, _ in results), results
    bad = [line for _, lines in results for line in lines]
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
def test_ipc_transport_across_hosts_is_refused():
    results = run_ranks(_hier_sweep, 2, RUN_TIMEOUT, args=("ipc",), start_method="spawn")
    assert results == [(0, []), (0, [])], results
