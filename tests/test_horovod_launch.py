"""plait-run for Horovod scripts: HOROVOD_* variables, horovodrun's -np/-H/--hostfile, elastic
runs with a really killed rank, and Horovod's examples (examples/horovod) run unchanged but for
the import line."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "horovod")
PRINT_ENV = (
    "import json, os; print('ENV ' + json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith('HOROVOD_')}), flush=True)"
)


def _run(args, timeout=240, env=None):
    e = dict(os.environ, **(env or {}))
    for k in ("RANK", "WORLD_SIZE", "PLAIT_STORE", "MASTER_PORT"):
        e.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "plait.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
        cwd=ROOT,
    )


def _envs(out):
    found = [json.loads(line.split(" ENV ", 1)[1]) for line in out.splitlines() if " ENV " in line]
    return sorted(found, key=lambda d: d["HOROVOD_RANK"])


def test_horovod_env_and_hosts(tmp_path):
    script = tmp_path / "env.py"
    script.write_text(PRINT_ENV + "\n")
    p = _run(["-np", "2", "-H", "localhost:2", "--tee-prefix", str(script)], timeout=60)
    assert p.returncode == 0, p.stderr
    envs = _envs(p.stdout)
    assert [e["HOROVOD_RANK"] for e in envs] == ["0", "1"], (p.stdout, p.stderr)
    for r, e in enumerate(envs):
        assert (
            e["HOROVOD_SIZE"] == "2" and e["HOROVOD_LOCAL_RANK"] == str(r) and e["HOROVOD_LOCAL_SIZE"] == "2"
        )
        assert e["HOROVOD_CROSS_RANK"] == "0" and e["HOROVOD_CROSS_SIZE"] == "1" and e["HOROVOD_HOSTNAME"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two slots here\nlocalhost slots=2\n127.0.0.1 slots=1\n")
    p = _run(["-np", "3", "--hostfile", str(hostfile), "--tee-prefix", str(script)], timeout=60)
    assert p.returncode == 0, p.stderr
    assert [e["HOROVOD_SIZE"] for e in _envs(p.stdout)] == ["3"] * 3
    p = _run(["-np", "4", "--hostfile", str(hostfile), str(script)], timeout=60)
    assert p.returncode == 2 and "more than the 3 slot(s)" in p.stderr
    p = _run(["-np", "2", "-H", "gpu-node-7.invalid:2", str(script)], timeout=60)
    assert p.returncode == 2 and "not this machine" in p.stderr
    p = _run(["-np", "2", "--min-np", "3", str(script)], timeout=60)
    assert p.returncode == 2 and "--min-np" in p.stderr


def _result(out):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][7:])


# The synthetic benchmarks at their smallest: resnet18 on 2 images of 32x32, two timed batches.
_TINY_SYNTHETIC = ["--model", "resnet18", "--batch-size", "2", "--image-size", "32"]
_TINY_SYNTHETIC += ["--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2"]


@pytest.mark.slow  # three ranks importing torch: 20 s on a quiet machine, 90 s on a loaded one
def test_elastic_killed_rank_shrinks_world():
    """Worker 1 of 3 SIGKILLs itself at batch 10: the survivors restore the last commit and go on
    as a world of 2; every step is applied exactly once (the weight is exactly 10 - 30 * 0.125)."""
    job = os.path.join(ROOT, "tests", "horovod_elastic_job.py")
    p = _run(["-np", "3", "--min-np", "2", "--max-np", "3", job], env={"HVD_TEST_KILL": "1:10"})
    assert p.returncode == 0, p.stdout + p.stderr
    res = _result(p.stdout)
    assert res["weights"] == [10.0 - 30 * 0.125] * 2
    sizes = res["sizes"]
    assert len(sizes) == 30 and sizes[0] == 3 and sizes[-1] == 2 and sorted(sizes, reverse=True) == sizes
    assert res["resets"] == [2]
    assert "worker 1" in p.stderr and "SIGKILL" in p.stderr and "elastic world 2: 2 rank(s)" in p.stderr


@pytest.mark.slow
def test_elastic_replacement_joins_at_commit():
    """As above, and the launcher starts a replacement (--restarts 1): it joins at the survivors'
    next commit (HostsUpdatedInterrupt) and the world is 3 again."""
    job = os.path.join(ROOT, "tests", "horovod_elastic_job.py")
    p = _run(
        ["-np", "3", "--min-np", "2", "--max-np", "3", "--restarts", "1", job],
        env={"HVD_TEST_KILL": "1:10", "HVD_TEST_REGROW": "3"},
        timeout=400,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    res = _result(p.stdout)
    assert res["weights"] == [10.0 - res["batch"] * 0.125] * 3
    sizes = res["sizes"]
    assert sizes[:11] == [3] * 11 and 2 in sizes and sizes[-5:] == [3] * 5
    assert res["resets"] == [2, 3]


@pytest.mark.slow
def test_example_synthetic_benchmark():
    p = _run(
        [
            "-np",
            "2",
            os.path.join(EXAMPLES, "pytorch_synthetic_benchmark.py"),
            *_TINY_SYNTHETIC,
        ]
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Number of CPUs: 2" in p.stdout and "Total img/sec on 2 CPU(s)" in p.stdout


@pytest.mark.slow
def test_example_mnist():
    p = _run(
        [
            "-np",
            "2",
            os.path.join(EXAMPLES, "pytorch_mnist.py"),
            "--epochs",
            "2",
            "--train-size",
            "1024",
            "--batch-size",
            "32",
            "--lr",
            "0.05",
        ]
    )
    assert p.returncode == 0, p.stdout + p.stderr
    acc = float(p.stdout.split("final accuracy")[1].split()[0])
    assert acc > 0.5, p.stdout  # ten classes: chance is 0.1


@pytest.mark.slow
def test_example_elastic_synthetic_benchmark():
    p = _run(
        [
            "-np",
            "2",
            "--min-np",
            "1",
            "--max-np",
            "2",
            os.path.join(EXAMPLES, "pytorch_synthetic_benchmark_elastic.py"),
            *_TINY_SYNTHETIC,
        ]
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Total img/sec on 2 CPU(s)" in p.stdout
