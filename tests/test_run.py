import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import plait
from plait import _shm

# The ranks must import the same plait as this test, however it got onto sys.path.
_PLAIT_ROOT = os.path.dirname(list(plait.__path__)[0])
_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PLAIT_ROOT, os.environ.get("PYTHONPATH")])))
_KEYS = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PLAIT_STORE",
]


@pytest.fixture(autouse=True)
def _deadline():
    def expired(*_):
        raise RuntimeError("test exceeded its 60 s deadline")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def launch(*args, timeout=30, **kw):
    return subprocess.run(
        [sys.executable, "-m", "plait.run", *map(str, args)],
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def script(tmp_path, body, name="rank.py"):
    path = tmp_path / name
    path.write_text(
        "import os, sys, time, json, signal\nRANK = int(os.environ['RANK'])\n" + textwrap.dedent(body)
    )
    return path


def wait_for(cond, seconds=10):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def pids_of(tmp_path, n):
    wait_for(lambda: all((tmp_path / f"pid-{r}").exists() for r in range(n)))
    return [int((tmp_path / f"pid-{r}").read_text()) for r in range(n)]


# Each rank records its pid (written atomically) and then sleeps until killed.
RECORD_PID = """
out = sys.argv[1]
with open(f"{out}/pid-{RANK}.tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(f"{out}/pid-{RANK}.tmp", f"{out}/pid-{RANK}")
"""


@pytest.mark.parametrize("n", [1, 3])
def test_environment_and_store(tmp_path, n):
    prog = script(
        tmp_path,
        f"""
        from plait._store import Store, store_from_env
        host, port, serve = store_from_env()
        env = {{k: os.environ.get(k) for k in {_KEYS!r}}}
        env.update(serve=serve, add=Store(host, port).add("ranks", 1), argv=sys.argv[1:])
        with open(os.path.join(sys.argv[1], f"env-{{RANK}}.json"), "w") as f:
            json.dump(env, f)
    """,
    )
    r = launch("-n", n, prog, tmp_path, "--", "-n", "7")
    assert r.returncode == 0, r.stderr
    envs = [json.loads((tmp_path / f"env-{rank}.json").read_text()) for rank in range(n)]
    assert sorted(e["add"] for e in envs) == list(range(1, n + 1))
    for rank, e in enumerate(envs):
        assert e["RANK"] == e["LOCAL_RANK"] == e["ROLE_RANK"] == str(rank)
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == str(n)
        assert e["GROUP_RANK"] == "0"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert 0 < int(e["MASTER_PORT"]) < 65536
        assert e["PLAIT_STORE"].startswith("127.0.0.1:") and e["PLAIT_STORE"] == envs[0]["PLAIT_STORE"]
        assert e["serve"] is False  # the launcher serves the store, not rank 0
        assert e["argv"] == [str(tmp_path), "--", "-n", "7"]


def test_master_options(tmp_path):
    prog = script(tmp_path, "print(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])")
    r = launch("-n", 2, "--master-addr", "localhost", "--master-port", 29555, "--", prog)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[0] localhost 29555", "[1] localhost 29555"]


def test_failing_rank_takes_down_the_others(tmp_path):
    prog = script(
        tmp_path,
        RECORD_PID
        + """
if RANK == 1:
    while not all(os.path.exists(f"{out}/pid-{r}") for r in range(3)):
        time.sleep(0.01)
    sys.exit(3)
time.sleep(60)
""",
    )
    start = time.monotonic()
    r = launch("-n", 3, prog, tmp_path)
    assert time.monotonic() - start < 15
    assert r.returncode == 3
    pid = (tmp_path / "pid-1").read_text()
    assert f"plait-run: rank 1 (pid {pid}) failed: exit code 3" in r.stderr
    for p in pids_of(tmp_path, 3):
        assert _shm._dead(p)


def test_rank_killed_by_signal(tmp_path):
    prog = script(
        tmp_path,
        RECORD_PID
        + """
if RANK == 0:
    while not os.path.exists(f"{out}/pid-1"):  # else rank 1 may be stopped before it records its pid
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
""",
    )
    r = launch("-n", 2, prog, tmp_path)
    assert r.returncode == 128 + signal.SIGKILL
    pid = (tmp_path / "pid-0").read_text()
    assert f"plait-run: rank 0 (pid {pid}) failed: killed by signal SIGKILL" in r.stderr
    assert _shm._dead(int((tmp_path / "pid-1").read_text()))


def test_module_and_prefixed_output(tmp_path):
    (tmp_path / "mymod.py").write_text("import os, sys\nprint('hi', os.environ['RANK'], sys.argv[1:])\n")
    r = launch("-n", 2, "--tee-prefix", "-m", "mymod", "a", "-n", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[0] hi 0 ['a', '-n']", "[1] hi 1 ['a', '-n']"]


def test_executable_and_usage_errors(tmp_path):
    r = launch("-n", 2, "sh", "-c", 'echo "$RANK"')
    assert r.returncode == 0 and sorted(r.stdout.splitlines()) == ["[0] 0", "[1] 1"]
    assert launch("-n", 2, tmp_path / "no-such-program").returncode == 127
    assert launch("-n", 0, "true").returncode != 0
    assert launch("-n", 1).returncode != 0


@pytest.mark.skipif(shutil.which("plait-run") is None, reason="plait-run is not installed")
def test_console_script():
    r = subprocess.run(
        ["plait-run", "-n", "2", "sh", "-c", 'echo "$RANK"'], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0 and sorted(r.stdout.splitlines()) == ["[0] 0", "[1] 1"]


def _start(tmp_path, n):
    prog = script(tmp_path, RECORD_PID + "time.sleep(60)\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "plait.run", "-n", str(n), str(prog), str(tmp_path)],
        env=_ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    return launcher, pids_of(tmp_path, n)


def test_sigterm_is_forwarded(tmp_path):
    launcher, pids = _start(tmp_path, 2)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=15) == 128 + signal.SIGTERM
    err = launcher.stderr.read()
    assert "plait-run: interrupted (SIGTERM): stopping 2 ranks" in err and "failed" not in err, err
    launcher.stderr.close()
    assert all(_shm._dead(p) for p in pids)


def test_killing_the_launcher_kills_the_ranks(tmp_path):
    launcher, pids = _start(tmp_path, 2)
    launcher.kill()
    launcher.wait(timeout=15)
    launcher.stderr.close()
    wait_for(lambda: all(_shm._dead(p) for p in pids))


def test_launcher_sweeps_segments_of_failed_ranks(tmp_path):
    prog = script(
        tmp_path,
        """
name = f"/dev/shm/plait-{os.getpid()}-{'ab' * 16}"
open(name, "w").close()
print(name)
sys.exit(1)
""",
    )
    r = launch("-n", 1, "--no-prefix", prog)
    name = r.stdout.strip()
    try:
        assert r.returncode == 1 and name
        assert not os.path.exists(name)
    finally:
        if name and os.path.exists(name):
            os.unlink(name)


def _dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_sweep_stale(tmp_path):
    zombie = subprocess.Popen(["true"])  # exited but not reaped yet: dead all the same
    wait_for(lambda: _shm._dead(zombie.pid))
    hexpart = os.urandom(16).hex()
    stale = [f"plait-{_dead_pid()}-{hexpart}", f"plait-{zombie.pid}-{hexpart}"]
    kept = [f"plait-{os.getpid()}-{hexpart}", f"plait-x-{hexpart}"]
    paths = [os.path.join("/dev/shm", n) for n in stale + kept]
    try:
        for p in paths:
            open(p, "w").close()
        assert set(stale + kept) <= set(_shm.list_segments())
        assert set(stale) <= set(_shm.sweep_stale())
        assert not set(stale) & set(_shm.list_segments())
        assert set(kept) <= set(_shm.list_segments())
    finally:
        zombie.wait()
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_sweep_stale_skips_other_users_and_missing_dirs(tmp_path):
    assert _shm.sweep_stale(str(tmp_path / "missing")) == []
    assert _shm.list_segments(str(tmp_path / "missing")) == []
    theirs = tmp_path / f"plait-{_dead_pid()}-{'0' * 32}"
    theirs.touch()
    if os.getuid() == 0:
        os.chown(theirs, 54321, -1)
        assert _shm.sweep_stale(str(tmp_path)) == []
        os.chown(theirs, 0, -1)
    assert _shm.sweep_stale(str(tmp_path)) == [theirs.name]


def test_segment_name():
    name = _shm.segment_name()
    prefix = f"/{_shm.SEGMENT_PREFIX}{os.getpid()}-"
    assert name.startswith(prefix) and len(name) == len(prefix) + 32
    int(name[len(prefix) :], 16)
