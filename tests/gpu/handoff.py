"""The two costs every GPU estimate rests on (tests/gpu/run.sh's hand-off stage):

- `ipc CALLS`: ranks sharing one GPU over CUDA IPC, CALLS 8-byte one_shot allreduces: wall time
  per call, i.e. per cross-rank hand-off (time-slicing without MPS, review 2 finding 11);
- `nccl CALLS`: a world of one over NCCL, CALLS enqueue-only 8-byte allreduces: host time per
  call (NCCL's non-blocking launch thread and plait's settle poll, review 2 finding 8).

    python -m plait.run -n 2 tests/gpu/handoff.py ipc 200
    python -m plait.run -n 1 tests/gpu/handoff.py nccl 2000

Rank 0 prints one line: "handoff <mode> n=<ranks> <us> us/call (<calls> calls)".
"""

import os
import sys
import time


def main():
    mode, calls = sys.argv[1], int(sys.argv[2])
    os.environ["PLAIT_GPU_TRANSPORT"] = "ipc" if mode == "ipc" else "nccl"
    import torch

    import plait

    comm = plait.init()
    torch.cuda.set_device(0 if mode == "ipc" else comm.rank % max(1, torch.cuda.device_count()))
    x = torch.ones(2, dtype=torch.float32, device="cuda")
    algo = "one_shot" if mode == "ipc" else "nccl"
    for _ in range(10):
        comm.allreduce(x, out=x, algorithm=algo)
    torch.cuda.synchronize()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        comm.allreduce(x, out=x, algorithm=algo)
    enqueued = time.perf_counter() - t0
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    us = (enqueued if mode == "nccl" else total) / calls * 1e6
    if comm.rank == 0:
        print(f"handoff {mode} n={comm.size} {us:.1f} us/call ({calls} calls)", flush=True)
    comm.finalize()


if __name__ == "__main__":
    main()
