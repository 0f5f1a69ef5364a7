"""plait-bench as an nccl-tests user types it: -n is ranks, and it cannot silently mean anything
else (0 is refused, more ranks than cores need --oversubscribe, each clashing short flag says what
it did); options whose packages are missing fail before the sweep with the pip command; the run
ends with nccl-tests' "# Avg bus bandwidth" line; the header says what the build has."""

import importlib.util
import os
import subprocess
import sys

import pytest

import plait
from plait.bench import cli, report

_ROOT = os.path.dirname(list(plait.__path__)[0])
_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
for _k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PLAIT_STORE", "OMPI_COMM_WORLD_SIZE"):
    _ENV.pop(_k, None)
_QUICK = ("-b", 8, "-e", 64, "-f", 8, "--time", 0.01, "--trials", 2)


def _bench(*args, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "plait.bench", *map(str, args)],
        env=_ENV,
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


def test_rank_counts_that_cannot_be_meant_are_refused():
    r = _bench("-n", 0, *_QUICK)
    assert r.returncode == 2 and "needs at least 1 rank" in r.stderr, r.stderr
    cores = len(os.sched_getaffinity(0))
    r = _bench("-n", cores + 1, *_QUICK)
    assert r.returncode == 2, r.stderr
    assert f"-n {cores + 1} would start {cores + 1} ranks on {cores} cores" in r.stderr
    assert "--iters" in r.stderr and "--oversubscribe" in r.stderr


def test_a_run_says_what_its_short_flags_did_and_ends_like_nccl_tests():
    r = _bench("-n", 2, "-c", "allreduce", "-a", "ring", *_QUICK)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "# -n 2: ranks (nccl-tests: iterations, --iters here)"
    assert lines[1].startswith("# -c allreduce: collectives (nccl-tests: check")
    assert lines[2].startswith("# -a ring: algorithm (nccl-tests: how to average")
    header = next(ln for ln in lines if ln.startswith("# plait-bench: 2 rank(s)"))
    assert "cuda True" not in header and "cuda False" not in header
    devices = plait.build_info()["cuda_devices"]
    gpu = "compiled with CUDA, %d device%s" % (devices, "s" * (devices != 1))
    assert (gpu if plait.build_info()["cuda"] else "CPU-only build") in header, header
    assert lines[-1].startswith("# Avg bus bandwidth    : ") and "GB/s (plait, mean of " in lines[-1]
    rows = [ln.split() for ln in lines if ln.strip() and not ln.startswith("#")]
    busbw = [float(row[8]) for row in rows] + [float(row[12]) for row in rows]  # both placements
    shown = float(lines[-1].split(":")[1].split()[0])
    assert shown == pytest.approx(sum(busbw) / len(busbw), rel=0.02, abs=0.01)


def test_long_options_print_no_notes():
    r = _bench("--nranks", 1, "--collectives", "broadcast", *_QUICK)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[0].startswith("# plait-bench: 1 rank(s)")


@pytest.mark.parametrize(
    "args,module,words",
    [
        (
            ["--plot", "x.png"],
            "matplotlib",
            "--plot needs matplotlib, which is not installed: pip install matplotlib",
        ),
        (
            ["--peers", "mpi"],
            "mpi4py",
            "--peers mpi needs mpi4py, which is not installed: pip install mpi4py",
        ),
        (["--peers", "deepspeed"], "deepspeed", "pip install deepspeed"),
        (["--peers", "gloo"], "torch", "pip install torch"),
    ],
)
def test_missing_packages_fail_before_the_sweep(monkeypatch, capsys, args, module, words):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_avg_busbw_prefers_auto_rows():
    rec = [
        {"impl": "plait", "busbw_GBps": 2.0},
        {"impl": "plait", "busbw_GBps": 4.0},
        {"impl": "plait:ring", "busbw_GBps": 100.0},
        {"impl": "gloo", "busbw_GBps": 50.0},
    ]
    assert report.avg_busbw(rec) == "# Avg bus bandwidth    : 3 GB/s (plait, mean of 2 rows)"
    assert report.avg_busbw(rec[2:]) == "# Avg bus bandwidth    : 100 GB/s (plait, mean of 1 rows)"
    assert report.avg_busbw(rec[3:]).endswith("n/a (no plait rows)")
