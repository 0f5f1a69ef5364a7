"""plait-run's Horovod side: horovodrun's options (-np, -H, --hostfile, --min-np, --max-np), the
HOROVOD_* variables of every rank, and the elastic supervisor. plait installs no `horovodrun`
(it would shadow a real Horovod): `plait-run -np 4 -H localhost:4 train.py` is the spelling.
"""

import signal
import socket
import subprocess
import sys
import time

_LOCAL = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}


def add_arguments(p):
    p.add_argument(
        "-H", "--hosts", default=None, help="horovodrun's host:slots,... (hosts of this machine only)"
    )
    p.add_argument("--hostfile", default=None, help="horovodrun's hostfile: lines 'host slots=N'")
    p.add_argument(
        "--min-np",
        "--min_np",
        dest="min_np",
        type=int,
        default=None,
        help="elastic: fewest ranks to go on with",
    )
    p.add_argument("--max-np", "--max_np", dest="max_np", type=int, default=None, help="elastic: most ranks")
    p.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="elastic: how many replacement ranks the launcher may start after failures",
    )


VALUE_OPTIONS = {"-H", "--hosts", "--hostfile", "--min-np", "--min_np", "--max-np", "--max_np", "--restarts"}


def _is_local(host):
    names = _LOCAL | {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def parse_hosts(spec):
    """[(host, slots)] of '-H a:2,b:4' (slots default 1)."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        host, _, slots = part.rpartition(":") if ":" in part and not part.startswith("[") else (part, "", "1")
        if not host:
            host, slots = part, "1"
        if not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H entry {part!r}: slots must be a positive integer")
        out.append((host, int(slots)))
    return out


def parse_hostfile(path):
    """[(host, slots)] of a horovodrun hostfile: 'host slots=N' per line, '#' comments."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            words = line.split()
            slots = 1
            for w in words[1:]:
                key, _, val = w.partition("=")
                if key not in ("slots", "max_slots") or not val.isdigit():
                    raise ValueError(f"{path}:{n}: expected 'host slots=N', got {line!r}")
                if key == "slots":
                    slots = int(val)
            out.append((words[0], slots))
    return out


def check(args, error):
    """Validates the Horovod options against -n; error(msg) exits as argparse does."""
    hosts = None
    try:
        if args.hosts:
            hosts = parse_hosts(args.hosts)
        if args.hostfile:
            hosts = (hosts or []) + parse_hostfile(args.hostfile)
    except (OSError, ValueError) as e:
        error(str(e))
    if hosts is not None:
        remote = [h for h, _ in hosts if not _is_local(h)]
        if remote:
            error(
                f"host(s) {', '.join(remote)} are not this machine: plait-run starts ranks here only; "
                "run plait-run --nnodes N --node-rank K ... on each host"
            )
        slots = sum(s for _, s in hosts)
        if args.nproc > slots:
            error(f"-np {args.nproc} is more than the {slots} slot(s) the hosts offer")
    args.hvd_hostname = hosts[0][0] if hosts else socket.gethostname()
    if args.min_np is not None or args.max_np is not None:
        lo = args.min_np if args.min_np is not None else 1
        hi = args.max_np if args.max_np is not None else args.nproc + max(args.restarts, 0)
        if not 1 <= lo <= args.nproc <= hi:
            error(f"elastic needs 1 <= --min-np ({lo}) <= -np ({args.nproc}) <= --max-np ({hi})")
        if args.nnodes > 1:
            error("elastic runs (--min-np/--max-np) are on one host only")
        args.min_np, args.max_np = lo, hi


def rank_env(args, rank, local, nproc, world):
    return {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(world),
        "HOROVOD_LOCAL_RANK": str(local),
        "HOROVOD_LOCAL_SIZE": str(nproc),
        "HOROVOD_CROSS_RANK": str(args.node_rank),
        "HOROVOD_CROSS_SIZE": str(args.nnodes),
        "HOROVOD_HOSTNAME": getattr(args, "hvd_hostname", None) or socket.gethostname(),
    }


def is_elastic(args):
    return args.min_np is not None


def elastic_main(args, cmd, env, client, spawn, take_down):
    """Runs an elastic job: keeps the world going while at least --min-np ranks live. spawn(env)
    starts one worker process; take_down(procs) stops them. Returns the exit code."""
    workers = {}  # worker id -> Popen
    order = []  # worker ids in rank order of the newest generation
    restarts = max(args.restarts, 0)
    next_id = 0
    finished = False

    def publish(ids):
        g = client.add("hvd/gen", 0) + 1
        for r, wid in enumerate(ids):
            client.set(f"hvd/gen/{g}/{wid}", f"{r},{len(ids)}".encode())
        client.add("hvd/gen", 1)
        order[:] = ids
        print(f"plait-run: elastic world {g}: {len(ids)} rank(s), workers {ids}", file=sys.stderr, flush=True)

    def start():
        nonlocal next_id
        wid = str(next_id)
        next_id += 1
        workers[wid] = spawn(dict(env, PLAIT_ELASTIC="1", PLAIT_WORKER_ID=wid, HOROVOD_ELASTIC="1"))
        return wid

    ids = [str(i) for i in range(args.nproc)]
    next_id = args.nproc
    publish(ids)
    for wid in ids:
        workers[wid] = spawn(
            dict(
                env,
                PLAIT_ELASTIC="1",
                PLAIT_WORKER_ID=wid,
                HOROVOD_ELASTIC="1",
                **rank_env(args, int(wid), int(wid), args.nproc, args.nproc),
            )
        )
    code = 0
    while True:
        alive = {w: p for w, p in workers.items() if p.poll() is None}
        for wid, p in list(workers.items()):
            rc = p.poll()
            if rc is None:
                continue
            del workers[wid]
            if rc == 0:
                finished = True
                continue
            what = f"exit code {rc}" if rc > 0 else f"killed by signal {signal.Signals(-rc).name}"
            print(
                f"plait-run: elastic worker {wid} (pid {p.pid}) failed: {what}", file=sys.stderr, flush=True
            )
            if finished:
                code = code or (rc if rc > 0 else 128 - rc)
                continue
            left = [w for w in order if w in alive]
            if len(left) < args.min_np:
                print(
                    f"plait-run: {len(left)} rank(s) left, fewer than --min-np {args.min_np}: stopping",
                    file=sys.stderr,
                    flush=True,
                )
                take_down(list(workers.values()))
                return rc if rc > 0 else 128 - rc
            publish(left)
            if restarts > 0 and len(left) < args.max_np:
                restarts -= 1
                start()
        if not workers:
            return code
        if finished and not any(w in workers for w in order):
            # The world finished its work; workers still waiting to join it have nothing to do.
            take_down(list(workers.values()))
            return code
        if not finished:
            for wid in list(workers):
                if wid not in order and client.add(f"hvd/waiting/{wid}", 0) > 0 and len(order) < args.max_np:
                    client.add(f"hvd/waiting/{wid}", -1)
                    publish(order + [wid])
        time.sleep(0.05)


def spawner(cmd, setup, procs):
    """spawn(env) for elastic_main; every process also goes into procs (the launcher's signal
    forwarding and final take-down see them)."""

    def spawn(env):
        p = subprocess.Popen(cmd, env=env, process_group=0, preexec_fn=setup)
        procs.append(p)
        return p

    return spawn
