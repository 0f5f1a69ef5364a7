"""Per-call cost of checking a GPU call against the other ranks, measured on the CPU.

The GPU queue is the recording stand-in (_C._FakeGpuQueue): the communicator's own GPU call path
runs (Python array protocol and checks, then C++ validate -> select -> check -> enqueue), and the
enqueue records the call instead of launching it. Three paths, interleaved in blocks in one job:

- "segment": the communicator's path, whose check compares fingerprints through the shared
  segment without waiting for anyone (what every one-host GPU call pays);
- "allreduce": the queue called on its own after a host allreduce of the fingerprint (what every
  GPU call paid before the segment check, and what a multi-host job's GPU calls still pay);
- "none": the queue called on its own with no check.

    plait-run -n 2 bench/gpu_check_overhead.py [rounds] [calls per block]

Prints the median per-call time of each (bench/RESULTS.md).
"""

import statistics
import sys
import time

import plait
from plait import _C, _cuda, _gpu


class _FakeArray:
    def __init__(self, ptr):
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": (2,),
            "typestr": "<f4",
            "strides": None,
            "version": 3,
            "stream": None,
        }


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 11
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    comm = plait.init()
    _cuda.compiled = lambda: True
    _cuda.device_count = lambda: 1
    _C.cuda_pointer_device = lambda ptr: 0
    if not _C.algorithms("allreduce", "nccl"):
        raise SystemExit("needs a CUDA build of plait (the GPU algorithm rows)")
    q = _C._FakeGpuQueue(comm._c, 0, "nccl", comm.timeout)
    _C.gpu_attach(comm._c, q)
    comm._gpu = q
    x, y = _FakeArray(1 << 20), _FakeArray(2 << 20)
    check, hier = _gpu._check_calls, _gpu._hierarchical
    paths = {
        "segment": (hier, check),
        "allreduce": (lambda c: True, check),
        "none": (lambda c: True, lambda *a: None),
    }
    times = {k: [] for k in paths}
    for r in range(rounds):
        for name in list(paths)[:: 1 if r % 2 else -1]:
            _gpu._hierarchical, _gpu._check_calls = paths[name]
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                comm.allreduce(x, out=y)
            comm.barrier()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    _gpu._hierarchical, _gpu._check_calls = hier, check
    if comm.rank == 0:
        m = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"GPU-path call on a recording GPU queue, {comm.size} ranks, {rounds} rounds x "
            f"{calls} calls: host-allreduce check {m['allreduce']:.2f} us/call, segment check "
            f"{m['segment']:.2f} us/call, no check {m['none']:.2f} us/call: the checks cost "
            f"{m['allreduce'] - m['none']:.2f} and {m['segment'] - m['none']:.2f} us"
        )
    assert len(q.records()) == 3 * rounds * calls, len(q.records())
    comm.finalize()


if __name__ == "__main__":
    main()
