"""Per-call cost of checking a GPU call against the other ranks, measured on the CPU: the GPU
communicator is a stand-in that records the call and enqueues nothing, so what is timed is
plait's Python GPU path (array protocol, validation) plus the check. Two checks, interleaved in
blocks in one job: the host allreduce of the call's fingerprint every GPU call used to pay
("allreduce"), the non-blocking compare through the shared segment ("segment"), and no check.

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


class _NoGpu:
    device = 0

    def call(self, *args):
        pass

    def finalize(self):
        pass


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 11
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    comm = plait.init()
    _cuda.compiled = lambda: True
    _cuda.device_count = lambda: 1
    _C.cuda_pointer_device = lambda ptr: 0
    gpu = _NoGpu()
    _gpu._communicator = lambda c, device, timeout, head: gpu
    x, y = _FakeArray(1 << 20), _FakeArray(2 << 20)
    native = comm._check_gpu_call
    checks = {"allreduce": None, "segment": native, "none": lambda *a: None}  # None: the old path
    times = {k: [] for k in checks}
    for r in range(rounds):
        for name in list(checks)[:: 1 if r % 2 else -1]:
            comm._check_gpu_call = checks[name]
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                comm.allreduce(x, out=y)
            comm.barrier()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    if comm.rank == 0:
        m = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"GPU-path call with a stand-in GPU communicator, {comm.size} ranks, {rounds} rounds x "
            f"{calls} calls: host-allreduce check {m['allreduce']:.2f} us/call, segment check "
            f"{m['segment']:.2f} us/call, no check {m['none']:.2f} us/call: the checks cost "
            f"{m['allreduce'] - m['none']:.2f} and {m['segment'] - m['none']:.2f} us"
        )
    comm.finalize()


if __name__ == "__main__":
    main()
