"""Two hosts simulated on one machine: two plait-run launchers, as you would start one on each
real host, with PLAIT_HOST_ID telling the ranks which "host" they are on. plait.init() then
returns a HierCommunicator: shared memory inside each host, gloo (torch) or MPI between hosts.

    python examples/multihost_sim.py                  # starts both "hosts", 2 ranks each
    python examples/multihost_sim.py --nproc 3

On real hosts, run on each: plait-run --nnodes 2 --node-rank K --master-addr HOST0 \\
    --master-port P -n 2 examples/multihost_sim.py --worker
Each rank prints its place and checks an allreduce against its closed form; exit status 0 means
every rank on both hosts got it right.
"""

import argparse
import os
import socket
import subprocess
import sys

import numpy as np


def worker():
    import plait

    comm = plait.init(timeout=60)
    rank, size = comm.rank, comm.size
    got = comm.allreduce(np.arange(6, dtype=np.int64) * (rank + 1))
    want = np.arange(6, dtype=np.int64) * (size * (size + 1) // 2)
    hosts = comm.allgather_object(os.environ.get("PLAIT_HOST_ID", socket.gethostname()))
    print(
        f"rank {rank} of {size} on host {hosts[rank]} (local rank {plait.local_rank()} of "
        f"{plait.local_size()}, {type(comm).__name__}): "
        f"allreduce {'ok' if np.array_equal(got, want) else 'WRONG'}",
        flush=True,
    )
    plait.finalize()
    sys.exit(0 if np.array_equal(got, want) else 1)


def free_port_pair():
    """A port whose successor is free too (node 0's launcher serves plait's store there)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help="be one rank (what the launchers start)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per simulated host")
    args = p.parse_args()
    if args.worker:
        return worker()
    port = free_port_pair()
    launchers = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "plait.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-n",
            str(args.nproc),
            os.path.abspath(__file__),
            "--worker",
        ]
        launchers.append(subprocess.Popen(cmd, env=dict(os.environ, PLAIT_HOST_ID=f"host{node}")))
    codes = [lp.wait(timeout=300) for lp in launchers]
    print(f"launchers exited with {codes}")
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
