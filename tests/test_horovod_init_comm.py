"""hvd.init(comm=...): a list of the launcher's ranks, or an mpi4py communicator, becomes the world
(ranked in its order), alone or next to other such worlds; bad lists are refused on the calling
rank; the whole world in order is the ordinary init."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def _sub_worlds(rank, n, _addr, lists):
    import plait.horovod.torch as hvd

    mine = next(ws for ws in lists if rank in ws)
    hvd.init(comm=mine)
    k = len(mine)
    got = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local": (hvd.local_rank(), hvd.local_size()),
        # sum over the members of (world rank + 1): the world is exactly these processes
        "sum": hvd.allreduce(torch.tensor([rank + 1, 10 * (rank + 1)]), op=hvd.Sum).tolist(),
        # gathered in the new ranks' order, i.e. the list's order
        "gather": hvd.allgather(torch.tensor([rank])).tolist(),
        # root 0 is the list's first process
        "bcast": hvd.broadcast(torch.tensor([rank * 7]), root_rank=0).tolist(),
        "names": hvd.allreduce(torch.ones(3), name="same.name.in.every.world", op=hvd.Sum).tolist(),
    }
    hvd.barrier()
    hvd.shutdown()
    # and the whole world afterwards, as a fresh init
    hvd.init()
    got["after"] = (hvd.size(), hvd.allreduce(torch.tensor([1]), op=hvd.Sum).item())
    hvd.shutdown()
    assert got["rank"] == mine.index(rank) and got["size"] == k, got
    assert got["local"] == (mine.index(rank), k), got
    s = sum(r + 1 for r in mine)
    assert got["sum"] == [s, 10 * s], got
    assert got["gather"] == list(mine), got
    assert got["bcast"] == [mine[0] * 7], got
    assert got["names"] == [float(k)] * 3, got
    assert got["after"] == (n, n), got
    return got["rank"]


def test_a_list_of_ranks_is_the_world_in_its_order(ranks):
    # 3 ranks: a world of two in reversed order ([2, 0]) and, at the same time, one of one ([1])
    assert ranks(_sub_worlds, 3, timeout=120, args=([[2, 0], [1]],)) == [1, 0, 0]
    # 4 ranks: two worlds of two side by side, each using the same tensor names
    assert ranks(_sub_worlds, 4, timeout=120, args=([[0, 1], [3, 2]],)) == [0, 1, 1, 0]


def _whole_and_refused(rank, n, _addr):
    import plait.horovod.torch as hvd

    errors = []
    for bad, kind in (
        ([0, 0], ValueError),  # repeated
        ([0, n], ValueError),  # outside the world
        ([], ValueError),
        ("01", TypeError),
        (3.5, TypeError),
        ([r for r in range(n) if r != rank], ValueError),  # this process is not in it
    ):
        with pytest.raises(kind) as e:
            hvd.init(comm=bad)
        assert f"rank {rank}" in str(e.value), str(e.value)
        assert not hvd.is_initialized()
        errors.append(kind.__name__)
    hvd.init(comm=list(range(n)))  # the whole world, in order: the ordinary init
    out = (hvd.rank(), hvd.size(), hvd.allreduce(torch.tensor([rank]), op=hvd.Sum).item())
    hvd.shutdown()
    assert out == (rank, n, n * (n - 1) // 2), out
    return errors


def test_whole_world_list_and_refused_lists(ranks):
    assert len(set(map(tuple, ranks(_whole_and_refused, 2, timeout=60)))) == 1


MPI_PROGRAM = """
import os, sys
import torch
from mpi4py import MPI
import plait.horovod.torch as hvd

world = MPI.COMM_WORLD
r, n = world.Get_rank(), world.Get_size()
out = []
# an mpi4py communicator: the odd and the even ranks, each its own Horovod world
sub = world.Split(color=r % 2, key=-r)  # reversed order inside each half
hvd.init(comm=sub)
mine = sorted((q for q in range(n) if q % 2 == r % 2), reverse=True)
assert (hvd.rank(), hvd.size()) == (mine.index(r), len(mine)), (hvd.rank(), hvd.size(), mine)
assert hvd.allreduce(torch.tensor([r + 1]), op=hvd.Sum).item() == sum(q + 1 for q in mine)
assert hvd.allgather(torch.tensor([r])).tolist() == mine
hvd.shutdown()
out.append("split")
# a list of ranks under mpirun without any store named: the members meet over MPI alone
if r in (0, 2):
    hvd.init(comm=[2, 0])
    assert (hvd.rank(), hvd.size()) == ([2, 0].index(r), 2)
    assert hvd.allreduce(torch.tensor([r]), op=hvd.Sum).item() == 2
    hvd.shutdown()
    out.append("list")
world.Barrier()
# COMM_WORLD itself: the ordinary world
hvd.init(comm=world)
assert (hvd.rank(), hvd.size()) == (r, n)
assert hvd.allreduce(torch.tensor([1]), op=hvd.Sum).item() == n
hvd.shutdown()
out.append("world")
with open(os.path.join(sys.argv[1], f"ok-{r}"), "w") as f:
    f.write(",".join(out))
"""


@pytest.mark.skipif(
    shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpirun and mpi4py",
)
def test_mpi4py_communicators_under_mpirun(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(MPI_PROGRAM)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "PLAIT_STORE", "MASTER_ADDR", "MASTER_PORT", "HOROVOD_RANK")
        and not k.startswith("HOROVOD_")
    }
    cmd = ["mpirun", "-np", "3", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    r = subprocess.run(
        cmd + [sys.executable, str(prog), str(tmp_path)], env=env, capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = {i: (tmp_path / f"ok-{i}").read_text() for i in range(3)}
    assert got == {0: "split,list,world", 1: "split,world", 2: "split,list,world"}, got
