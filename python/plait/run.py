"""plait-run: starts N local ranks with torchrun's environment and a plait store, and takes them all
down as soon as one fails.

    plait-run -n N [--master-addr A] [--master-port P] [--tee-prefix] [--] program [args...]
    plait-run -n N -m module [args...]

The ranks get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK,
ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch's own store; plait leaves it alone) and
PLAIT_STORE=host:port, the store this launcher serves.
"""
import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from . import _shm, _store

_PR_SET_PDEATHSIG = 1
_VALUE_OPTIONS = {"-n", "--nproc", "--nproc-per-node", "--nproc_per_node", "--master-addr",
                  "--master_addr", "--master-port", "--master_port", "--grace"}


def _parser():
    p = argparse.ArgumentParser(
        prog="plait-run", usage="%(prog)s -n N [options] [--] (program.py | -m module | executable) [args...]",
        description="Run N local ranks of a plait (or torch.distributed) program.")
    p.add_argument("-n", "--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int,
                   required=True, help="number of ranks")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="MASTER_PORT for the ranks (default: a free port)")
    p.add_argument("-m", "--module", action="store_true", help="the program is a Python module")
    p.add_argument("--tee-prefix", action="store_true", help="prefix each output line with [rank]")
    p.add_argument("--grace", type=float, default=3.0,
                   help="seconds between SIGTERM and SIGKILL when taking the ranks down")
    return p


def _parse(argv):
    # argparse's REMAINDER drops a "--" meant for the program, so split by hand at the program.
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 2 if argv[i] in _VALUE_OPTIONS else 1
    p = _parser()
    args = p.parse_args(argv[:i])
    rest = argv[i + 1:] if i < len(argv) and argv[i] == "--" else argv[i:]
    if not rest:
        p.error("no program given")
    if args.nproc < 1:
        p.error("-n must be at least 1")
    args.program, args.args = rest[0], rest[1:]
    return args


def _command(args):
    if args.module:
        return [sys.executable, "-m", args.program, *args.args]
    if args.program.endswith(".py"):
        return [sys.executable, args.program, *args.args]
    return [args.program, *args.args]


def _free_port(host):
    # Any local address will do (ports are per family), and host may well be a remote name.
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent():
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork, not in the child
    parent = os.getpid()

    def setup():
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)
    return setup


def _pump(src, dst, prefix, lock):
    out = getattr(dst, "buffer", None)
    for line in iter(src.readline, b""):
        with lock:
            if out is not None:
                out.write(prefix + line)
            else:
                dst.write((prefix + line).decode(errors="replace"))
            dst.flush()
    src.close()


def _signal_group(proc, sig):
    # Each rank leads its own process group, so a signal reaches whatever the rank started too.
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe(rc):
    if rc >= 0:
        return f"exit code {rc}", rc
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    return f"killed by signal {name}", 128 - rc


def _take_down(procs, grace):
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in procs:
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _supervise(procs, grace):
    while True:
        running = False
        for rank, p in enumerate(procs):
            rc = p.poll()
            running |= rc is None
            if rc:
                what, code = _describe(rc)
                print(f"plait-run: rank {rank} (pid {p.pid}) failed: {what}", file=sys.stderr, flush=True)
                _take_down(procs, grace)
                return code
        if not running:
            return 0
        time.sleep(0.02)


def main(argv=None):
    args = _parse(sys.argv[1:] if argv is None else list(argv))
    n, cmd = args.nproc, _command(args)
    server = _store.StoreServer("127.0.0.1", 0)
    env = dict(os.environ, WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), ROLE_WORLD_SIZE=str(n),
               GROUP_RANK="0", MASTER_ADDR=args.master_addr,
               MASTER_PORT=str(args.master_port or _free_port(args.master_addr)),
               PLAIT_STORE=f"{server.host}:{server.port}")
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks x all-core thread pools oversubscribe
    if args.tee_prefix:
        env.setdefault("PYTHONUNBUFFERED", "1")  # otherwise lines arrive only when a rank exits
    procs, pumps, lock, signals = [], [], threading.Lock(), []

    def forward(signum, _frame):
        signals.append(signum)
        for p in procs:  # a second signal means the ranks ignored the first one
            _signal_group(p, signum if len(signals) == 1 else signal.SIGKILL)

    on_main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    try:
        setup = _die_with_parent()
        for rank in range(n):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            pipe = subprocess.PIPE if args.tee_prefix else None
            try:
                # Spawned from this (main) thread on purpose: PDEATHSIG fires when the creating
                # thread exits, not the process.
                p = subprocess.Popen(cmd, env=rank_env, stdout=pipe, stderr=pipe, process_group=0,
                                     preexec_fn=setup)
            except OSError as e:
                print(f"plait-run: cannot start rank {rank} ({cmd[0]}): {e}", file=sys.stderr, flush=True)
                _take_down(procs, args.grace)
                return 127
            procs.append(p)
            if args.tee_prefix:
                for src, dst in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                    t = threading.Thread(target=_pump, args=(src, dst, f"[{rank}] ".encode(), lock),
                                         daemon=True)
                    t.start()
                    pumps.append(t)
        code = _supervise(procs, args.grace)
        return 128 + signals[0] if code == 0 and signals else code
    finally:
        if any(p.poll() is None for p in procs):  # only on an unexpected error in here
            _take_down(procs, args.grace)
        for s, h in old.items():
            signal.signal(s, h)
        server.close()
        _shm.sweep_stale()
        for t in pumps:
            t.join(timeout=1)  # a rank's leftover children may hold the pipe open


if __name__ == "__main__":
    sys.exit(main())
