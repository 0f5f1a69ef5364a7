"""plait-run as a torchrun user types it: --standalone, --nproc-per-node auto, --rdzv-endpoint,
--log-dir, --local-ranks-filter, --max-restarts, --no-python; whole, rank-prefixed output lines;
Ctrl-C reported as an interrupt."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import plait

_PLAIT_ROOT = os.path.dirname(list(plait.__path__)[0])
_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PLAIT_ROOT, os.environ.get("PYTHONPATH")])))


def launch(*args, timeout=60, **kw):
    return subprocess.run(
        [sys.executable, "-m", "plait.run", *map(str, args)],
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **kw,
    )


def program(tmp_path, body, name="prog.py"):
    path = tmp_path / name
    path.write_text("import os, sys, time\nRANK = int(os.environ['RANK'])\n" + textwrap.dedent(body))
    return path


def _cpus():
    return len(os.sched_getaffinity(0))


def test_standalone_auto_and_rdzv_endpoint(tmp_path):
    prog = program(
        tmp_path, "print(os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])"
    )
    r = launch("--standalone", "--nproc-per-node", "auto", prog)
    assert r.returncode == 0, r.stderr
    n = plait.build_info()["cuda_devices"] if plait.cuda_available() else _cpus()
    lines = r.stdout.splitlines()
    assert sorted(ln.split()[0] for ln in lines) == [f"[{i}]" for i in range(n)]
    assert {ln.split()[1] for ln in lines} == {str(n)}
    r = launch("-n", "cpu", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29561", prog)
    assert r.returncode == 0, r.stderr
    assert {ln.split(" ", 2)[2] for ln in r.stdout.splitlines()} == {"localhost 29561"}
    r = launch("--nproc_per_node", "1", "--rdzv_endpoint", "127.0.0.1", prog)
    assert r.stdout.splitlines() == ["[0] 1 127.0.0.1 29400"], r.stderr


def test_refusals_say_why(tmp_path):
    prog = program(tmp_path, "pass")
    for args, words in [
        (("-n", "0", prog), "at least 1"),
        (("-n", "many", prog), "auto, cpu, gpu"),
        (("--standalone", "--nnodes", "2", "-n", "1", prog), "--standalone is one node"),
        (("--nnodes", "2", "--master-port", "29562", "--max-restarts", "1", "-n", "1", prog), "one node"),
        (("-n", "2", "--local-ranks-filter", "5", prog), "local rank(s) [5]"),
        (("-n", "2", "--rdzv-endpoint", "host:port", prog), "HOST[:PORT]"),
    ]:
        r = launch(*args)
        assert r.returncode == 2 and words in r.stderr, (args, r.stderr)


def test_lines_stay_whole_and_prefixed(tmp_path):
    # Each rank writes 200 lines of 301 bytes in 7-byte raw writes, racing the other rank, then a
    # traceback to stderr: without line buffering in the launcher the two ranks' bytes interleave
    # mid-line. (Neither fails: the first failure would take the other rank down mid-output.)
    prog = program(
        tmp_path,
        """
        import traceback
        for i in range(200):
            line = (f"rank {RANK} line {i:03d} " + "x" * 300)[:300] + "\\n"
            for k in range(0, len(line), 7):
                os.write(1, line[k : k + 7].encode())
        try:
            raise RuntimeError(f"boom {RANK}")
        except RuntimeError:
            traceback.print_exc()
        """,
    )
    r = launch("-n", 2, prog)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert len(out) == 400
    for rank in (0, 1):
        mine = [ln for ln in out if ln.startswith(f"[{rank}] ")]
        want = [f"[{rank}] " + (f"rank {rank} line {i:03d} " + "x" * 300)[:300] for i in range(200)]
        assert mine == want
    errs = [ln for ln in r.stderr.splitlines() if not ln.startswith("plait-run:")]
    assert all(ln.startswith(("[0] ", "[1] ")) for ln in errs), errs
    assert "[0] RuntimeError: boom 0" in errs and "[1] RuntimeError: boom 1" in errs, errs


def test_log_dir_and_local_ranks_filter(tmp_path):
    prog = program(tmp_path, "print('out', RANK)\nprint('err', RANK, file=sys.stderr)")
    r = launch("-n", 3, "--log-dir", tmp_path / "logs", "--local-ranks-filter", "1", prog)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[1] out 1"]
    assert r.stderr.splitlines() == ["[1] err 1"]
    for rank in range(3):
        folder = tmp_path / "logs" / "attempt_0" / str(rank)
        assert (folder / "stdout.log").read_text() == f"out {rank}\n"
        assert (folder / "stderr.log").read_text() == f"err {rank}\n"


def test_no_prefix_and_no_python(tmp_path):
    r = launch("-n", 2, "--no-prefix", "--no-python", "sh", "-c", 'echo "$RANK"')
    assert r.returncode == 0 and sorted(r.stdout.splitlines()) == ["0", "1"]


def test_max_restarts_starts_every_rank_again(tmp_path):
    # Rank 0 joins plait at once; rank 1 fails before joining on the first attempt, so the
    # second attempt must get a fresh store, or its init would meet the first attempt's count.
    prog = program(
        tmp_path,
        """
        import numpy as np, plait
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if RANK == 1 and attempt == 0:
            time.sleep(0.5)
            sys.exit(7)
        comm = plait.init(timeout=30)
        got = comm.allreduce(np.full(3, RANK + 1, np.int64))
        print("attempt", attempt, os.environ["TORCHELASTIC_MAX_RESTARTS"], got.tolist())
        plait.finalize()
        """,
    )
    r = launch("-n", 2, "--max-restarts", 2, prog, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "plait-run: rank 1 (pid" in r.stderr and "failed: exit code 7" in r.stderr
    assert "plait-run: restarting all 2 ranks (restart 1 of 2)" in r.stderr
    assert "restart 2 of 2" not in r.stderr
    assert sorted(r.stdout.splitlines()) == ["[0] attempt 1 2 [3, 3, 3]", "[1] attempt 1 2 [3, 3, 3]"]
    r = launch("-n", 2, "--max_restarts", 1, "sh", "-c", "exit 5")
    assert r.returncode == 5 and r.stderr.count("failed: exit code 5") == 2, r.stderr


def test_ctrl_c_is_an_interrupt(tmp_path):
    prog = program(tmp_path, "open(f'{sys.argv[1]}/up-{RANK}', 'w').close()\ntime.sleep(60)")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "plait.run", "-n", "2", str(prog), str(tmp_path)],
        env=_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"up-{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGINT
    assert "plait-run: interrupted (SIGINT): stopping 2 ranks" in err, err
    assert "failed" not in err, err
