"""End-to-end cost of the flight recorder: an 8-byte allreduce on a communicator made with
PLAIT_FLIGHT=0 against one made with it on, in the same job, timed in interleaved blocks.

    plait-run -n 2 bench/flight_overhead.py [rounds] [calls per block]

Prints the median per-call time of each and their difference (bench/RESULTS.md).
"""

import os
import statistics
import sys
import time

import numpy as np

import plait


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    os.environ["PLAIT_FLIGHT"] = "0"
    off = plait.init(set_default=False)
    os.environ["PLAIT_FLIGHT"] = "1"
    on = plait.init(set_default=False)
    assert plait.dump(off)["slots"] == 0 and plait.dump(on)["slots"] > 0
    x = np.ones(2, np.float32)
    out = np.empty_like(x)
    times = {"off": [], "on": []}
    for r in range(rounds):
        for name, comm in (("off", off), ("on", on)) if r % 2 else (("on", on), ("off", off)):
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                comm.allreduce(x, out)
            times[name].append((time.perf_counter() - t0) / calls * 1e9)
    assert out.tolist() == [off.size] * 2
    if off.rank == 0:
        m = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"8-byte allreduce, {off.size} ranks, {rounds} rounds x {calls} calls: "
            f"PLAIT_FLIGHT=0 {m['off']:.0f} ns/call, on {m['on']:.0f} ns/call, "
            f"difference {m['on'] - m['off']:+.0f} ns (per-round on-off: "
            f"{', '.join(f'{a - b:+.0f}' for a, b in zip(times['on'], times['off']))})"
        )
    off.finalize()
    on.finalize()


if __name__ == "__main__":
    main()
