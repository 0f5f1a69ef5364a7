"""plait-bench --hosts: flat and hierarchical plait timed side by side on simulated hosts."""

import json
import subprocess
import sys

import pytest

from test_bench import _ENV

pytestmark = pytest.mark.slow  # minutes of multi-process runs: full suite only

pytest.importorskip("torch")


def test_flat_and_hierarchical_in_one_run(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.bench",
            "-n",
            "4",
            "--oversubscribe",  # 4 ranks on the 2-core VM
            "--hosts",
            "2",
            "-c",
            "allreduce,reduce_scatter",
            "-b",
            "64",
            "-e",
            "4K",
            "-f",
            "64",
            "--time",
            "0.02",
            "--trials",
            "1",
            "-w",
            "0",
            "--json",
            str(out),
        ],
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "hier-gloo: plait over 2 simulated hosts" in r.stdout and "host 1: ranks [2, 3]" in r.stdout
    assert "plait/hier-gloo" in r.stdout and "#wrong total: 0 OK" in r.stdout
    recs = json.loads(out.read_text())["results"]
    for coll in ("allreduce", "reduce_scatter"):
        for impl in ("plait", "hier-gloo"):
            mine = [x for x in recs if x["collective"] == coll and x["impl"] == impl]
            assert sorted({x["bytes"] for x in mine}) == [64, 4096] and all(x["wrong"] == 0 for x in mine)
            assert all(x["nranks"] == 4 and x["time_us"] > 0 for x in mine)


def test_hosts_must_divide_the_ranks_sensibly():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.bench",
            "-n",
            "2",
            "--hosts",
            "3",
            "-c",
            "allreduce",
            "-b",
            "8",
            "-e",
            "8",
        ],
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "--hosts 3 needs 2..2" in r.stdout + r.stderr
