"""plait's per-call overhead over MPI's own allreduce between simulated hosts, in one run.

    python bench/mpi_overhead.py                 # starts `mpirun -np 2` on itself
    python bench/mpi_overhead.py -n 4 --hosts 2  # 2 simulated hosts x 2 ranks

Each rank sets PLAIT_HOST_ID to its host (ranks split in order) before plait.init(), so plait
takes its multi-host path with the MPI engine between the simulated hosts. For each size
(float64 sum; 8 B by default) it times, in batches alternating between them so the machine's
drift hits all alike:

    mpi4py   comm.Allreduce(IN_PLACE, a): MPI's own allreduce, blocking (the floor)
    engine   plait._mpi's engine alone (EngineForTests.allreduce: pybind + Iallreduce + Test loop)
    plait    comm.allreduce(a) on the HierCommunicator plait.init() returns (the direct numpy API)

and prints on rank 0 the median and the fastest batch's time per call of each, and engine -
mpi4py and plait - mpi4py: the overhead the issue bounds at 10 us for 8 B with one rank per
host. On a loaded machine the fastest batches (both ranks on a core throughout) are the better
estimate of the overhead: a blocking MPI call's busy poll suffers most from being descheduled. Results:
bench/RESULTS-hier.md ("The MPI engine's overhead").
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def _batch(comm, fn, iters):
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _launch(a, argv):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)")
    cmd = [mpirun, "-np", str(a.n), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PLAIT_STORE")}
    return subprocess.call(cmd + [sys.executable, os.path.abspath(__file__), *argv], env=env)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=2, help="ranks (when this script starts mpirun)")
    ap.add_argument("--hosts", type=int, default=2, help="simulated hosts (ranks split in order)")
    ap.add_argument("--sizes", default="8", help="bytes, comma separated (multiples of 8)")
    ap.add_argument("--batches", type=int, default=15)
    ap.add_argument("--budget", type=float, default=0.1, help="seconds per timed batch (sets iterations)")
    ap.add_argument("--json", help="rank 0 writes the rows here too")
    a = ap.parse_args(argv)
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        return _launch(a, argv)
    rank, n = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    if n % a.hosts:
        raise SystemExit(f"{n} ranks do not split evenly over {a.hosts} hosts")
    os.environ["PLAIT_HOST_ID"] = f"bench-host{rank // (n // a.hosts)}"

    import numpy as np
    from mpi4py import MPI

    import plait
    from plait import _mpi

    world = MPI.COMM_WORLD.Dup()
    comm = plait.init(timeout=120)
    engine = _mpi.EngineForTests(_mpi.make_engine(world, "bench"))
    rows = []
    for size in (int(s) for s in a.sizes.split(",")):
        x = np.ones(size // 8, dtype=np.float64)
        calls = {
            "mpi4py": lambda x=x: world.Allreduce(MPI.IN_PLACE, x, MPI.SUM),
            "engine": lambda x=x: engine.allreduce(x, "sum"),
            "plait": lambda x=x: comm.allreduce(x),
        }
        for fn in calls.values():  # warm up, and size the batches on the slowest
            _batch(world, fn, 20)
        per = max(_batch(world, fn, 50) for fn in calls.values())
        iters = max(20, int(world.allreduce(a.budget * 1e6 / per, op=MPI.MIN)))
        times = {k: [] for k in calls}
        for _ in range(a.batches):
            for k, fn in calls.items():
                # the slowest rank's batch: a collective is as slow as its last member
                times[k].append(world.allreduce(_batch(world, fn, iters), op=MPI.MAX))
        med = {k: _median(v) for k, v in times.items()}
        low = {k: min(v) for k, v in times.items()}
        rows.append(
            dict(
                bytes=size,
                iters=iters,
                **{f"{k}_us": round(v, 2) for k, v in med.items()},
                **{f"{k}_min_us": round(v, 2) for k, v in low.items()},
                engine_over_us=round(med["engine"] - med["mpi4py"], 2),
                plait_over_us=round(med["plait"] - med["mpi4py"], 2),
                engine_over_min_us=round(low["engine"] - low["mpi4py"], 2),
                plait_over_min_us=round(low["plait"] - low["mpi4py"], 2),
            )
        )
    if rank == 0:
        print(f"{n} ranks, {a.hosts} simulated hosts, plait {type(comm).__name__} engine={comm.engine}")
        print("per call, us: median batch (fastest batch)")
        print(
            f"{'bytes':>9} {'mpi4py':>16} {'engine':>16} {'plait':>16} "
            f"{'engine-mpi4py':>18} {'plait-mpi4py':>18}"
        )
        for r in rows:
            cells = [
                f"{r[k + '_us']:.2f} ({r[k + '_min_us']:.2f})" for k in ("mpi4py", "engine", "plait")
            ] + [f"{r[k + '_us']:.2f} ({r[k + '_min_us']:.2f})" for k in ("engine_over", "plait_over")]
            print(
                f"{r['bytes']:>9} "
                + " ".join(f"{c:>16}" for c in cells[:3])
                + " "
                + " ".join(f"{c:>18}" for c in cells[3:])
            )
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    engine.close()
    comm.finalize()
    world.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
