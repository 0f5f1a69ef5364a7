"""plait-bench: nccl-tests-style bandwidth benchmark of plait's collectives, with peers.

    plait-bench -n 2                                   # short default sweep, launches 2 ranks
    plait-bench -n 2 -c allreduce -b 8 -e 64M -f 4 -a all --peers gloo,mpi --json out.json
    plait-run -n 4 --no-prefix -m plait.bench -c allgather   # or under plait-run / torchrun / mpirun

See bench/README.md for the columns. Exit status: 0, 1 when any result was wrong, 2 on bad usage.
"""

from .cli import main

__all__ = ["main"]
