"""plait-run: starts N local ranks with torchrun's environment and a plait store, and takes them all
down as soon as one fails.

    plait-run -n N [--master-addr A] [--master-port P] [--] program [args...]
    plait-run -n N -m module [args...]
    plait-run --nnodes 2 --node-rank K --master-addr A --master-port P -n N program   (on each host)
    plait-run -n N --dump-on-error DIR program
    plait-run --standalone --nproc-per-node auto --log-dir logs --max-restarts 2 train.py  (torchrun's)

Output: every line a rank writes reaches the console whole, prefixed "[rank] " (--no-prefix: the
ranks write to the launcher's stdout and stderr themselves); --local-ranks-filter 0,1 shows only
those local ranks; --log-dir DIR also writes DIR/attempt_K/RANK/{stdout,stderr}.log.
--max-restarts K: after a rank fails, all ranks start again (with a fresh plait store, and
TORCHELASTIC_RESTART_COUNT set), up to K times; one node only. Ctrl-C (SIGINT) or SIGTERM stops
the ranks and is reported as an interrupt, exit code 128 + the signal.

--dump-on-error DIR: a rank that raises TimeoutError, PeerLostError or MismatchError writes its
flight recorder report to DIR/flight-rank<R>.json (PLAIT_DUMP_ON_ERROR), and the launcher, once
the ranks are down, prints one summary of every rank's last calls instead of one per rank.

The ranks get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK,
ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch's own store; plait leaves it alone) and
PLAIT_STORE=host:port, the store this launcher serves (node 0's launcher, at MASTER_PORT+1, with
several nodes). With several nodes every launcher watches a failure flag in that store: a rank
failing on any node stops the ranks of every node, each launcher naming the node and rank.
"""

import argparse
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from . import _flight, _run_output, _shm, _store
from .horovod import _launch as _hvd

_PR_SET_PDEATHSIG = 1
_VALUE_OPTIONS = {
    "-n",
    "--nproc",
    "--nproc-per-node",
    "--nproc_per_node",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
    "--grace",
    "--nnodes",
    "--node-rank",
    "--node_rank",
    "--dump-on-error",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-backend",
    "--rdzv_backend",
    "--rdzv-id",
    "--rdzv_id",
    "--log-dir",
    "--log_dir",
    "--local-ranks-filter",
    "--local_ranks_filter",
    "--max-restarts",
    "--max_restarts",
    "-np",
} | _hvd.VALUE_OPTIONS
_FAILED, _DONE = "plait-run/failed", "plait-run/done"  # keys of the multi-node launchers


def _parser():
    p = argparse.ArgumentParser(
        prog="plait-run",
        usage="%(prog)s -n N [options] [--] (program.py | -m module | executable) [args...]",
        description="Run N local ranks of a plait (or torch.distributed) program.",
    )
    p.add_argument(
        "-n",
        "-np",
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        required=True,
        help="ranks on this node: a number, or auto (a rank per CUDA device when there are any, "
        "else per CPU), cpu, gpu",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="one node with a local rendezvous (plait-run's default; accepted as torchrun's)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="HOST[:PORT]",
        help="node 0's address (torchrun's; port 29400 when left out): --master-addr/--master-port",
    )
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="static", choices=("static", "c10d"))
    p.add_argument("--rdzv-id", "--rdzv_id", default="none", help="exported as TORCHELASTIC_RUN_ID")
    p.add_argument("--log-dir", "--log_dir", default=None, help="also write each rank's output here")
    p.add_argument(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default=None,
        metavar="0,1,...",
        help="show only these local ranks' output on the console (--log-dir keeps all)",
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="start all ranks again after a failure, up to this many times (one node only)",
    )
    p.add_argument("--no-python", "--no_python", action="store_true", help="run the program as is")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (hosts), one plait-run each")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this node's index")
    p.add_argument(
        "--master-addr",
        "--master_addr",
        default="127.0.0.1",
        help="address of node 0 (its launcher serves plait's store at MASTER_PORT+1)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="MASTER_PORT for the ranks (default: a free port)",
    )
    p.add_argument("-m", "--module", action="store_true", help="the program is a Python module")
    p.add_argument("--no-prefix", action="store_true", help="ranks write to the console unprefixed")
    p.add_argument("--tee-prefix", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument(
        "--grace",
        type=float,
        default=3.0,
        help="seconds between SIGTERM and SIGKILL when taking the ranks down",
    )
    p.add_argument(
        "--dump-on-error",
        metavar="DIR",
        default=None,
        help="ranks write their flight recorder report here on a timeout, lost peer or "
        "mismatch; the launcher prints one summary of all ranks",
    )
    _hvd.add_arguments(p)  # horovodrun's -H, --hostfile, --min-np, --max-np
    return p


def _parse(argv):
    # argparse's REMAINDER drops a "--" meant for the program, so split by hand at the program.
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 2 if argv[i] in _VALUE_OPTIONS else 1
    p = _parser()
    args = p.parse_args(argv[:i])
    rest = argv[i + 1 :] if i < len(argv) and argv[i] == "--" else argv[i:]
    if not rest:
        p.error("no program given")
    args.nproc = _nproc(p, args.nproc)
    if args.standalone and args.nnodes != 1:
        p.error(f"--standalone is one node, not --nnodes {args.nnodes}")
    if args.rdzv_endpoint:
        host, colon, port = args.rdzv_endpoint.rpartition(":")
        if not colon:  # torchrun's default rendezvous port
            host, port = args.rdzv_endpoint, "29400"
        if not port.isdigit():
            p.error(f"--rdzv-endpoint {args.rdzv_endpoint!r} is not HOST[:PORT]")
        args.master_addr, args.master_port = host.strip("[]") or args.master_addr, int(port)
    if args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    if args.max_restarts and args.nnodes > 1:
        p.error(
            "--max-restarts with --nnodes > 1 is not supported: plait-run restarts the ranks of one "
            "node only (the other nodes' launchers would not follow)"
        )
    args.shown = None
    if args.local_ranks_filter is not None:
        try:
            args.shown = {int(v) for v in args.local_ranks_filter.split(",") if v.strip()}
        except ValueError:
            p.error(f"--local-ranks-filter {args.local_ranks_filter!r} is not a list like 0,1")
        outside = sorted(r for r in args.shown if not 0 <= r < args.nproc)
        if outside:
            p.error(f"--local-ranks-filter names local rank(s) {outside}, not in 0..{args.nproc - 1}")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank {args.node_rank} is not a node of --nnodes {args.nnodes}")
    if args.nnodes > 1 and args.master_port is None:
        p.error("--nnodes > 1 needs --master-port (the same on every node)")
    _hvd.check(args, p.error)
    args.program, args.args = rest[0], rest[1:]
    return args


def _nproc(p, text):
    """-n's value: a positive number, or torchrun's auto / cpu / gpu."""
    if text in ("auto", "cpu", "gpu"):
        gpus = 0
        if text != "cpu":
            from . import _cuda

            gpus = _cuda.device_count() if _cuda.compiled() else 0
            if text == "gpu" and gpus == 0:
                p.error("-n gpu: this process sees no CUDA device (or plait was built without CUDA)")
        return gpus or len(os.sched_getaffinity(0))
    try:
        n = int(text)
    except ValueError:
        p.error(f"-n {text!r}: give a number of ranks, or auto, cpu, gpu")
    if n < 1:
        p.error("-n must be at least 1")
    return n


def _command(args):
    if args.no_python:
        return [args.program, *args.args]
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


def _linger(procs, seconds):
    """Gives the other ranks up to `seconds` to fail on their own (and write their reports)."""
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)


def _interrupted(procs, grace, where, signum):
    """The launcher got SIGINT or SIGTERM (already forwarded to the ranks): an interrupt, not a
    failure of whichever rank the signal ended first."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    alive = sum(p.poll() is None for p in procs)
    print(f"plait-run: {where}interrupted ({name}): stopping {len(procs)} ranks", file=sys.stderr, flush=True)
    if alive:
        _linger(procs, grace)
    _take_down(procs, grace)
    return 128 + signum


def _supervise(procs, grace, first=0, nodes=None, linger=0.0, signals=()):
    """Waits for the ranks (global ranks first, first+1, ...); nodes: the multi-node store client.
    linger: seconds the others get after a failure before they are taken down. signals: the
    signals the launcher received (filled in by its handler)."""
    where = f"node {nodes[1]}: " if nodes else ""
    next_check = 0.0
    while True:
        if signals:
            return _interrupted(procs, grace, where, signals[0])
        running = False
        for i, p in enumerate(procs):
            rc = p.poll()
            running |= rc is None
            if rc and signals:  # the signal came after the check above, and ended this rank
                return _interrupted(procs, grace, where, signals[0])
            if rc:
                what, code = _describe(rc)
                msg = f"{where}rank {first + i} (pid {p.pid}) failed: {what}"
                print(f"plait-run: {msg}", file=sys.stderr, flush=True)
                if nodes:
                    _flag(nodes[0], msg)
                _linger(procs, linger)
                _take_down(procs, grace)
                return code
        if not running:
            return 0
        if nodes and time.monotonic() >= next_check:
            next_check = time.monotonic() + 0.2
            other = _flagged(nodes[0])
            if other is not None:
                print(f"plait-run: {where}stopping its ranks: {other}", file=sys.stderr, flush=True)
                _take_down(procs, grace)
                return 1
        time.sleep(0.02)


def _flag(client, msg):
    try:
        client.set(_FAILED + "/msg", msg.encode())
        client.add(_FAILED, 1)
    except Exception:  # noqa: BLE001 - the store (node 0) may be gone; the ranks notice anyway
        pass


def _flagged(client):
    """The failure another node's launcher reported, or None."""
    try:
        if client.add(_FAILED, 0) <= 0:
            return None
        return client.get(_FAILED + "/msg", timeout=5).decode()
    except Exception as e:  # noqa: BLE001
        return f"the plait store on node 0 is gone ({e})"


def _wait_for_nodes(client, nnodes):
    """Node 0 keeps serving the store until every node's launcher is done (or one failed)."""
    while True:
        try:
            if client.add(_DONE, 0) >= nnodes or client.add(_FAILED, 0) > 0:
                return
        except Exception:  # noqa: BLE001
            return
        time.sleep(0.1)


def _node_store(args, token):
    """(server or None, "host:port", nodes or None) of this launch; None when node 0 is unreachable."""
    if args.nnodes == 1:
        server = _store.StoreServer("127.0.0.1", 0, token=token)
        return server, f"{server.host}:{server.port}", None
    server = None
    if args.node_rank == 0:
        try:
            server = _store.StoreServer(args.master_addr, args.master_port + 1, token=token)
        except Exception:  # noqa: BLE001 - e.g. a name of this host that is not bound locally
            server = _store.StoreServer("0.0.0.0", args.master_port + 1, token=token)
    store_addr = f"{args.master_addr}:{args.master_port + 1}"
    try:
        nodes = (
            _store.Store(args.master_addr, args.master_port + 1, timeout=300, token=token),
            args.node_rank,
        )
    except Exception as e:  # noqa: BLE001
        print(
            f"plait-run: node {args.node_rank}: cannot reach node 0's store at {store_addr}: {e}",
            file=sys.stderr,
            flush=True,
        )
        if server is not None:
            server.close()
        return None
    return server, store_addr, nodes


def _start(args, cmd, env, output, attempt, procs):
    """Starts this node's ranks into `procs`; an exit code when one cannot start, else None."""
    first = args.nproc * args.node_rank
    setup = _die_with_parent()
    for local in range(args.nproc):
        rank = first + local
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(local), ROLE_RANK=str(rank))
        rank_env.update(_hvd.rank_env(args, rank, local, args.nproc, args.nproc * args.nnodes))
        try:
            # Spawned from this (main) thread on purpose: PDEATHSIG fires when the creating
            # thread exits, not the process.
            p = subprocess.Popen(cmd, env=rank_env, process_group=0, preexec_fn=setup, **output.popen_args())
        except OSError as e:
            print(f"plait-run: cannot start rank {rank} ({cmd[0]}): {e}", file=sys.stderr, flush=True)
            _take_down(procs, args.grace)
            return 127
        procs.append(p)
        output.attach(p, rank, local, attempt)
    return None


def main(argv=None):
    args = _parse(sys.argv[1:] if argv is None else list(argv))
    n, cmd = args.nproc, _command(args)
    world, first = n * args.nnodes, n * args.node_rank
    # The job's store admits only its ranks: they get a fresh secret in the environment. Several
    # nodes' launchers cannot agree on a fresh one: there the user's PLAIT_STORE_TOKEN (the same
    # on every node) serves, else the store stays open as before.
    token = os.environ.get(_store.TOKEN_ENV) or (secrets.token_hex(16) if args.nnodes == 1 else None)
    made = _node_store(args, token)
    if made is None:
        return 1
    server, store_addr, nodes = made
    env = dict(
        os.environ,
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(n),
        ROLE_WORLD_SIZE=str(world),
        GROUP_RANK=str(args.node_rank),
        MASTER_ADDR=args.master_addr,
        MASTER_PORT=str(args.master_port or _free_port(args.master_addr)),
        PLAIT_STORE=store_addr,
        TORCHELASTIC_RUN_ID=args.rdzv_id,
        TORCHELASTIC_MAX_RESTARTS=str(args.max_restarts),
        TORCHELASTIC_RESTART_COUNT="0",
    )
    if token:
        env[_store.TOKEN_ENV] = token
    if args.dump_on_error:
        os.makedirs(args.dump_on_error, exist_ok=True)
        env["PLAIT_DUMP_ON_ERROR"] = os.path.abspath(args.dump_on_error)
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks x all-core thread pools oversubscribe
    output = _run_output.RankOutput(not args.no_prefix, args.log_dir, args.shown)
    output.env(env)
    procs, signals = [], []

    def forward(signum, _frame):
        signals.append(signum)
        for p in procs:  # a second signal means the ranks ignored the first one
            _signal_group(p, signum if len(signals) == 1 else signal.SIGKILL)

    on_main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    try:
        if _hvd.is_elastic(args):
            client = _store.Store(server.host, server.port, timeout=60, token=token)
            try:
                spawn = _hvd.spawner(cmd, _die_with_parent(), procs)
                return _hvd.elastic_main(args, cmd, env, client, spawn, lambda ps: _take_down(ps, args.grace))
            finally:
                client.close()
        attempt = 0
        while True:
            code = _start(args, cmd, env, output, attempt, procs)
            if code is not None:
                return code
            linger = args.grace if args.dump_on_error else 0.0
            code = _supervise(procs, args.grace, first, nodes, linger, signals)
            if not code or signals or attempt >= args.max_restarts:
                break
            attempt += 1
            print(
                f"plait-run: restarting all {n} ranks (restart {attempt} of {args.max_restarts})",
                file=sys.stderr,
                flush=True,
            )
            output.join()
            procs.clear()
            _shm.sweep_stale()  # segments the failed attempt's ranks created and never unlinked
            # A fresh store (and torch port) per attempt: the failed one's counters are half used.
            server.close()
            server = _store.StoreServer("127.0.0.1", 0, token=token)
            env.update(
                PLAIT_STORE=f"{server.host}:{server.port}",
                TORCHELASTIC_RESTART_COUNT=str(attempt),
                MASTER_PORT=str(args.master_port or _free_port(args.master_addr)),
            )
        if code and args.dump_on_error and not signals:
            text = _flight.side_by_side(_flight.load_dir(args.dump_on_error), args.dump_on_error)
            if text:
                print("plait-run: " + text, file=sys.stderr, flush=True)
        if nodes and code == 0 and not signals:
            nodes[0].add(_DONE, 1)
            if args.node_rank == 0:
                _wait_for_nodes(nodes[0], args.nnodes)
        elif nodes and signals:
            _flag(nodes[0], f"node {args.node_rank}: plait-run stopped by signal {signals[0]}")
        return 128 + signals[0] if signals else code
    finally:
        if any(p.poll() is None for p in procs):  # only on an unexpected error in here
            _take_down(procs, args.grace)
        for s, h in old.items():
            signal.signal(s, h)
        if nodes:
            nodes[0].close()
        if server is not None:
            server.close()
        _shm.sweep_stale()
        output.join()


if __name__ == "__main__":
    sys.exit(main())
