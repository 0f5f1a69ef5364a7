"""The examples in examples/ run, alone and under plait-run, and print what they say they print
(examples/ddp_train.py is run by tests/test_torch_backend.py)."""

import os
import re
import subprocess
import sys

import pytest

import plait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PLAIT_ROOT = os.path.dirname(list(plait.__path__)[0])
_ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PLAIT_STORE", "MASTER_PORT")}
_ENV["PYTHONPATH"] = os.pathsep.join(filter(None, [_PLAIT_ROOT, os.environ.get("PYTHONPATH")]))


def _run(name, ranks, *args, timeout=300):
    path = os.path.join(ROOT, "examples", name)
    cmd = (
        [sys.executable, path] if ranks == 0 else [sys.executable, "-m", "plait.run", "-n", str(ranks), path]
    )
    r = subprocess.run(
        cmd + list(args), env=_ENV, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("ranks", [0, 2])  # 0: plain `python example.py`, a world of one
def test_numpy_data_parallel(ranks):
    lines = _run("numpy_data_parallel.py", ranks)
    prefix = "[0] " if ranks else ""
    assert [ln[: len(prefix) + 8] for ln in lines[:5]] == [
        f"{prefix}step {s:3d}" for s in (20, 40, 60, 80, 100)
    ]
    m = re.fullmatch(
        re.escape(prefix)
        + r"(\d) rank\(s\); weights identical on every rank: True; max \|w - true_w\| = (\S+)",
        lines[-1],
    )
    assert m and int(m.group(1)) == max(ranks, 1) and float(m.group(2)) < 0.01, lines[-1]


@pytest.mark.parametrize("ranks", [0, 2, 4])
def test_tensor_parallel(ranks):
    (line,) = _run("tensor_parallel.py", ranks)
    m = re.search(r"max \|parallel - serial\| = (\S+), hidden layer gathered \(8, 256\), equal: True$", line)
    assert m and float(m.group(1)) < 1e-12, line
    assert f"{max(ranks, 1)} rank(s), {256 // max(ranks, 1)} hidden units each" in line


def test_fsdp2_train():
    pytest.importorskip("torch")
    lines = _run("fsdp2_train.py", 2, "--epochs", "2", "--steps", "5", timeout=600)
    assert [ln.split(":")[0] for ln in lines[:2]] == ["[0] epoch 1", "[0] epoch 2"]
    assert all(ln.endswith("[plait, 2 ranks]") for ln in lines[:2])
    m = re.fullmatch(r"\[0\] parameters: (\d+) in all, held per rank: \[(\d+), (\d+)\]", lines[2])
    assert m and int(m.group(2)) + int(m.group(3)) == int(m.group(1)), lines


@pytest.mark.slow  # two launchers and gloo between the simulated hosts
def test_multihost_sim():
    pytest.importorskip("torch")
    lines = _run("multihost_sim.py", 0, timeout=600)
    assert lines[-1] == "launchers exited with [0, 0]"
    for r in range(4):
        place = f"rank {r} of 4 on host host{r // 2} (local rank {r % 2} of 2, HierCommunicator)"
        assert f"[{r}] {place}: allreduce ok" in lines, lines


@pytest.mark.slow  # gloo, fake, native and Python groups, ~1 min on the 2-core VM
def test_torch_overhead_prints_measurements_not_targets():
    pytest.importorskip("torch")
    r = subprocess.run(
        [sys.executable, "-m", "plait.run", "-n", "2", "-m", "plait.torch.overhead"]
        + ["--iters", "30", "--gloo-iters", "10", "--no-train"],
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "target" not in r.stdout, r.stdout
    lines = r.stdout.splitlines()
    assert any(ln.startswith("[0]   dist.all_reduce, gloo ") for ln in lines), lines
    assert any(ln.startswith("[0]   plait comm.allreduce on numpy ") for ln in lines), lines
    if any("fake (torch's floor)" in ln for ln in lines):  # the fake group is not in every torch build
        assert any(ln.startswith("[0]   torch's floor (fake group, no work; medians): sync ") for ln in lines)
