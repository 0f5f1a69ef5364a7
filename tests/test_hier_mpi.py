"""The MPI engine between simulated hosts: plait under a real mpirun, PLAIT_HOST_ID from the MPI rank."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from conftest import _creator, _segment_names
from test_run import _ENV

WHY = (
    "mpirun is not on PATH"
    if shutil.which("mpirun") is None
    else "mpi4py is not installed"
    if importlib.util.find_spec("mpi4py") is None
    else None
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        WHY is not None, reason=f"{WHY} (apt-get install openmpi-bin libopenmpi-dev && pip install mpi4py)"
    ),
]

TESTS = os.path.dirname(os.path.abspath(__file__))
# No RANK, WORLD_SIZE or store in the environment: plait takes mpirun's ranks and rank 0 serves the
# store, its address broadcast over MPI.
PROGRAM = f"""
import os, sys
hosts = sys.argv[1].split(",")
os.environ["PLAIT_HOST_ID"] = hosts[int(os.environ["OMPI_COMM_WORLD_RANK"])]
sys.path.insert(0, {TESTS!r})
import plait, hier_checks as hc
comm = plait.init(timeout=60, buffer_bytes=8192)
assert type(comm).__name__ == "HierCommunicator" and comm.engine == "mpi", repr(comm)
n = 0
for count in (0, 1, 7):
    n += hc.reductions(comm, count) + hc.movements(comm, count)
n += hc.reductions(comm, 3001, dtypes=["float16", "bfloat16"], ops=["sum", "avg"])  # reduced by numpy
n += hc.reductions(comm, 3001, dtypes=["int32"], ops=["sum"])
n += hc.asynchronous(comm)
sub = comm.split(color=comm.rank % 2)
n += hc.reductions(sub, 5, dtypes=["float32"])
sub.finalize()
comm.finalize()
with open(os.path.join(sys.argv[2], f"checks-{{comm.rank}}"), "w") as f:  # not stdout: mpirun may interleave
    f.write(str(n))
"""


def _mpirun(tmp_path, hosts):
    prog = tmp_path / "mpi_rank.py"
    prog.write_text(PROGRAM)
    env = {
        k: v
        for k, v in _ENV.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "PLAIT_STORE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "PLAIT_INTER",
            "PLAIT_HOST_ID",
        )
    }
    cmd = ["mpirun", "-np", str(len(hosts)), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    before = _segment_names()
    r = subprocess.run(
        cmd + [sys.executable, str(prog), ",".join(hosts), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    checks = [int((tmp_path / f"checks-{rank}").read_text()) for rank in range(len(hosts))]
    assert len(set(checks)) == 1 and checks[0] > 700, checks
    # segments made meanwhile by processes that are gone: ours (other users' live ones are not)
    left = {s for s in _segment_names() - before if not os.path.exists(f"/proc/{_creator(s)}")}
    assert not left, left


@pytest.mark.parametrize(
    "hosts", [["a", "a", "b", "b"], ["a", "b", "c"], ["a", "a", "b"]], ids=["2x2", "3x1", "uneven-2+1"]
)
def test_mpi_engine_exact(tmp_path, hosts):
    _mpirun(tmp_path, hosts)
