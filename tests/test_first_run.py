"""A newcomer's first run: `python train.py` with no launcher is a world of one; a half-set launcher
environment says how to launch; `dist.init_process_group("plait")` works without `import plait.torch`
(torch's "torch.backends" entry point), and that hook costs `import torch` no compile; `dir(plait)`
shows the API and nothing else."""

import os
import subprocess
import sys
import textwrap

import pytest

import plait

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _python(code, timeout=120, **extra):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("PLAIT_STORE")}
    env.update(extra)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_one_process_world_without_a_launcher():
    r = _python(
        """
        import numpy as np, plait
        for args in ((), (0, 1)):
            comm = plait.init(*args)
            x = np.arange(5, dtype=np.int64)
            got = plait.allreduce(x)
            print(plait.rank(), plait.size(), plait.local_rank(), plait.local_size(), got.tolist(),
                  comm.allgather_object({"r": 0}), plait.alltoallv(x, [5]).tolist())
            plait.finalize()
        """
    )
    assert r.returncode == 0, r.stderr
    line = "0 1 0 1 [0, 1, 2, 3, 4] [{'r': 0}] [0, 1, 2, 3, 4]"
    assert r.stdout.splitlines() == [line, line]


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"WORLD_SIZE": "4"}])
def test_half_a_launcher_environment_names_plait_run(env):
    r = _python("import plait; plait.init()", **env)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("plait._errors.InvalidArgument") and "plait-run -n N train.py" in last, last


def test_dir_of_plait_is_its_api():
    names = {n for n in dir(plait) if not n.startswith("_")}
    modules = {n for n in names if type(getattr(plait, n)).__name__ == "module"}  # plait.torch, ...
    assert names - modules == set(plait.__all__)
    for name in ("rank", "size", "local_rank", "local_size", "gather", "alltoallv", "broadcast_object"):
        assert name in plait.__all__


def test_torch_finds_the_backend_without_importing_plait_torch():
    pytest.importorskip("torch")
    r = _python(
        """
        import sys
        import torch
        assert "plait.torch" not in sys.modules, "the hook must not import plait.torch (it compiles)"
        import torch.distributed as dist
        assert "plait" in dist.Backend.backend_list
        dist.init_process_group("plait", store=dist.HashStore(), rank=0, world_size=1)
        t = torch.arange(6, dtype=torch.float32)
        dist.all_reduce(t)
        print(dist.get_backend(), t.tolist(), "plait.torch" in sys.modules)
        print(dist.Backend._plugins["PLAIT"].creator_fn.__module__)
        dist.destroy_process_group()
        """,
        timeout=600,  # the first use compiles the native backend into PLAIT_CACHE_DIR
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["plait [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] True", "plait.torch"]


def test_torch_autoload_can_be_turned_off():
    pytest.importorskip("torch")
    r = _python(
        """
        import sys, torch
        import torch.distributed as dist
        print("plait" in sys.modules, "plait" in dist.Backend.backend_list)
        """,
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]
