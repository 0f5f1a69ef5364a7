"""Command line and launching of plait-bench (one rank's work is in driver.py).

Without RANK/WORLD_SIZE in the environment, plait-bench starts its own ranks: under mpirun when the
MPI peer is wanted and works (so plait, gloo and MPI run in the same processes, interleaved), else
under plait-run. With them (plait-run, torchrun) or under mpirun, this process is one rank.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

from .collectives import COLLECTIVES, DTYPES, OPS
from .driver import ENV_SKIPPED, run_rank

DEFAULT_COLLECTIVES = "allreduce,reduce_scatter,allgather"
_ALIASES = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "reducescatter": "reduce_scatter",
    "all_to_all": "alltoall",
    "bcast": "broadcast",
    "float": "float32",
    "half": "float16",
    "double": "float64",
    "int": "int32",
    "bf16": "bfloat16",
}
_ENV_CHILD = "PLAIT_BENCH_CHILD"  # set by our own launch: the ranks need not re-check -n


def parse_size(text):
    """'8', '1K', '64M', '1G', '4MiB', '1.5k' -> bytes (binary multiples, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 1K, 64M, 1G)")
    shift = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]
    return int(float(m.group(1)) * (1 << shift))


def sizes(lo, hi, factor):
    if lo < 1 or hi < lo:
        raise ValueError(f"need 1 <= min bytes <= max bytes, got {lo} and {hi}")
    if factor < 2 and hi > lo:
        raise ValueError("the step factor -f must be at least 2")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        if factor < 2:
            break
        s *= factor
    return out


def _names(text, known, what):
    if text == "all":
        return list(known)
    names = [_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what}: {', '.join(bad)} (known: {', '.join(known)})")
    return names


def parser():
    p = argparse.ArgumentParser(
        prog="plait-bench",
        description="nccl-tests-style bandwidth benchmark "
        "of plait's collectives, with gloo and MPI side by side.",
    )
    a = p.add_argument
    a(
        "-n",
        "--nranks",
        type=int,
        help="ranks to start (default 2; nccl-tests' -n is iterations, --iters here); under a "
        "launcher, the number it started",
    )
    a(
        "--oversubscribe",
        action="store_true",
        help="allow more ranks than this process may use cores (they then share cores and spin)",
    )
    a("-b", "--minbytes", type=parse_size, default=8, help="smallest size (default 8)")
    a("-e", "--maxbytes", type=parse_size, default=8 << 20, help="largest size (default 8M)")
    a("-f", "--stepfactor", type=int, default=4, help="size multiplier between rows (default 4)")
    a(
        "-c",
        "--collectives",
        type=lambda t: _names(t, COLLECTIVES, "collective"),
        default=DEFAULT_COLLECTIVES.split(","),
        help=f"comma list or 'all' (default {DEFAULT_COLLECTIVES})",
    )
    a(
        "-d",
        "--dtype",
        type=lambda t: _names(t, DTYPES, "dtype")[0],
        default="float32",
        help=f"{', '.join(DTYPES)} (default float32)",
    )
    a("-o", "--op", choices=OPS, default="sum", help="reduction op (default sum)")
    a("-r", "--root", type=int, default=0, help="root of broadcast and reduce (default 0)")
    a("-a", "--algorithm", default="auto", help="'auto' (default), 'all' or a comma list of algorithms")
    a(
        "--shared",
        action="store_true",
        help="also time plait (auto) over buffers from plait.empty, which peers on the host map instead "
        "of reaching through kernel copies (row plait+shared; like nccl-tests' registered buffers)",
    )
    a("-w", "--warmup", type=int, default=2, help="warm-up calls per measurement (default 2)")
    a("--iters", type=int, default=0, help="iterations per trial (default: from --time, 1..1000)")
    a("--trials", type=int, default=5, help="trials per measurement; the median is reported (default 5)")
    a("--time", type=float, default=0.2, help="seconds per measurement, all trials (default 0.2)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--inplace", action="store_true", help="only in-place calls")
    g.add_argument("--outofplace", action="store_true", help="only out-of-place calls")
    a("--buffer-bytes", type=parse_size, help="plait's staging bytes per rank (plait.init buffer_bytes)")
    a(
        "--hosts",
        type=int,
        default=0,
        help="also time plait's hierarchical path with the ranks split "
        "into this many simulated hosts (PLAIT_HOST_ID; consecutive ranks per host), as peer hier-<engine>",
    )
    a(
        "--peers",
        type=lambda t: _names(t, ("gloo", "mpi", "deepspeed"), "peer"),
        default=[],
        help="gloo,mpi,deepspeed",
    )
    a("--json", metavar="FILE", help="write every measurement and the machine info as JSON")
    a("--plot", metavar="FILE.png", help="plot busbw and latency vs size (needs matplotlib)")
    a("--seed", type=int, default=1, help="seed of the check data (default 1)")
    a("--no-pin", action="store_true", help="do not pin ranks to cores")
    a(
        "--trace",
        metavar="DIR",
        help="write a Chrome/Perfetto trace of every plait call per rank into "
        "DIR (PLAIT_TRACE; open in ui.perfetto.dev or chrome://tracing)",
    )
    a(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default) or cuda: GPU arrays, plait's GPU algorithms vs nccl (bench/gpu.py)",
    )
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    _check_packages(p, args)
    try:
        args.sizes = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    except ValueError as e:
        p.error(str(e))
    if args.trials < 1 or args.warmup < 0 or args.iters < 0 or args.time <= 0:
        p.error("need --trials >= 1, -w >= 0, --iters >= 0 and --time > 0")
    if (
        args.op == "avg"
        and not args.dtype.startswith(("float", "bfloat"))
        and any(COLLECTIVES[c].reduces for c in args.collectives)
    ):
        p.error(f"op avg needs a float dtype, not {args.dtype}")
    if args.trace:  # the ranks inherit it from here (launcher) or read it again (each rank)
        os.makedirs(args.trace, exist_ok=True)
        os.environ["PLAIT_TRACE"] = os.path.abspath(args.trace)
    mpi = _under_mpirun()
    if mpi or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        size = int(
            os.environ.get("WORLD_SIZE")
            or os.environ.get("OMPI_COMM_WORLD_SIZE")
            or os.environ.get("PMI_SIZE")
        )
        if args.nranks and not os.environ.get(_ENV_CHILD) and args.nranks != size:
            p.error(f"-n {args.nranks} but the launcher started {size} ranks")
    else:
        size = 2 if args.nranks is None else args.nranks
    if size < 1:
        p.error(f"-n {size}: plait-bench needs at least 1 rank")
    if not (mpi or "RANK" in os.environ):
        cores = len(os.sched_getaffinity(0))
        if size > cores and not args.oversubscribe:
            p.error(
                f"-n {size} would start {size} ranks on {cores} cores: -n is the number of ranks here "
                "(nccl-tests' -n, iterations, is --iters); add --oversubscribe to start them anyway"
            )
    if not os.environ.get(_ENV_CHILD) and os.environ.get("RANK", "0") == "0":
        for line in _short_flag_notes(argv, args, size):
            print(line, flush=True)
    if not 0 <= args.root < size and any(COLLECTIVES[c].rooted for c in args.collectives):
        p.error(f"root {args.root} is not a rank of {size}")
    if args.device == "cuda" and (args.peers or mpi):
        p.error("--device cuda compares plait with NCCL only: no --peers, no mpirun")
    if "RANK" in os.environ and args.device == "cuda":
        from .gpu import run_gpu_rank

        return run_gpu_rank(args)
    if mpi or "RANK" in os.environ:
        return run_rank(args, argv, mpi)
    return _launch(args, argv, size)


_CLASHES = {  # plait-bench's short flags that nccl-tests reads differently
    "-n": ("nranks", "ranks", "nccl-tests: iterations, --iters here"),
    "-c": ("collectives", "collectives", "nccl-tests: check results 0/1; plait-bench always checks"),
    "-a": ("algorithm", "algorithm", "nccl-tests: how to average across ranks 0..3; here rank 0's median"),
}


def _short_flag_notes(argv, args, size):
    """One line per clashing short flag the command used, saying what plait-bench made of it."""
    notes = []
    for flag, (dest, what, theirs) in _CLASHES.items():
        if any(t == flag or (t.startswith(flag) and not t.startswith("--")) for t in argv):
            value = size if dest == "nranks" else getattr(args, dest)
            value = ",".join(value) if isinstance(value, list) else value
            notes.append(f"# {flag} {value}: {what} ({theirs})")
    return notes


def _check_packages(p, args):
    """Options whose packages are missing fail now, with the pip command, not after the sweep."""
    import importlib.util

    need = []
    if args.plot:
        need.append(("--plot", "matplotlib", "matplotlib"))
    for peer, module, pip in (
        ("gloo", "torch", "torch"),
        ("mpi", "mpi4py", "mpi4py"),
        ("deepspeed", "deepspeed", "deepspeed"),
    ):
        if peer in args.peers:
            need.append((f"--peers {peer}", module, pip))
    for option, module, pip in need:
        if importlib.util.find_spec(module) is None:
            extra = " (or pip install 'plait[bench]')" if pip in ("matplotlib", "mpi4py") else ""
            p.error(f"{option} needs {module}, which is not installed: pip install {pip}{extra}")


def _under_mpirun():
    return "RANK" not in os.environ and ("OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ)


# -- launching ---------------------------------------------------------------------------------
def _mpirun_cmd(n):
    cmd = ["mpirun", "-n", str(n), "--bind-to", "none"]  # the ranks pin themselves, as under plait-run
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if n > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    return cmd


def _probe_mpi(n):
    """None when mpirun can start n mpi4py ranks here, else why not."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return (
            "mpi4py is not installed (pip install mpi4py; it needs an MPI, e.g. "
            "apt-get install openmpi-bin libopenmpi-dev)"
        )
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (apt-get install openmpi-bin)"
    code = "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"
    try:
        r = subprocess.run(
            _mpirun_cmd(n) + [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return f"mpirun did not start {n} mpi4py ranks within 60 s"
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["exit code %d" % r.returncode])[-1]
        return f"mpirun failed: {last}"
    return None


def _launch(args, argv, n):
    skipped = {}
    if "mpi" in args.peers:
        why = _probe_mpi(n)
        if why:
            skipped["mpi"] = why
    env = {ENV_SKIPPED: json.dumps(skipped), _ENV_CHILD: "1"}
    module = [sys.executable, "-m", "plait.bench", *argv]
    if "mpi" in args.peers and "mpi" not in skipped:
        return subprocess.run(_mpirun_cmd(n) + module, env=dict(os.environ, **env)).returncode
    from .. import run

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # plait-run hands its own environment to the ranks
    try:
        return run.main(["-n", str(n), "--no-prefix", "-m", "plait.bench", *argv])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
