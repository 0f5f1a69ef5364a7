"""One rank of plait-bench: join plait and the peers, sweep, and (rank 0) print and write it all."""

import json
import os
import sys
import time

from . import harness, report
from .collectives import COLLECTIVES
from .peers import IN, OUT, Mpi, Plait, Skip, plait_impls, start_deepspeed, start_gloo

ENV_SKIPPED = "PLAIT_BENCH_SKIPPED"  # peers the launcher found unusable, passed to the ranks


def run_rank(args, argv, mpi):
    """Exit status of this rank: 0, or 1 when any result was wrong (every rank agrees)."""
    if mpi:
        from mpi4py import MPI

        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        local = (
            int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)),
            int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)),
        )
    else:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", size))
    try:
        return _run(args, argv, rank, size, local, mpi)
    except BaseException:
        if mpi:  # mpirun would otherwise wait for the other ranks forever
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        raise


def _pin(local_rank, local_size):
    """Pins this rank to one core when the ranks fit: unpinned spinners sometimes share a core."""
    cpus = sorted(os.sched_getaffinity(0))
    if local_size > len(cpus):
        return None
    os.sched_setaffinity(0, {cpus[local_rank]})
    return cpus[local_rank]


def _rendezvous(mpi, rank):
    """(plait store, torch init_method, server to keep). Under mpirun rank 0 serves both and MPI
    tells the others where; under plait-run/torchrun the environment says (None)."""
    if not mpi:
        return None, None, None
    from mpi4py import MPI

    from .. import _store
    from ..run import _free_port

    server = _store.StoreServer("127.0.0.1", 0) if rank == 0 else None
    ports = MPI.COMM_WORLD.bcast((server.port, _free_port("127.0.0.1")) if server else None, root=0)
    return ("127.0.0.1", ports[0]), f"tcp://127.0.0.1:{ports[1]}", server


def _start_peers(names, rank, size, init_method, mpi, skipped):
    peers = []
    # gloo first: DeepSpeed rides the torch.distributed group gloo creates (and closes last).
    for name in sorted(names, key=lambda n: n != "gloo"):
        if name in skipped:
            continue
        try:
            if name == "gloo":
                peers.append(start_gloo(rank, size, init_method))
            elif name == "deepspeed":
                peers.append(start_deepspeed(rank, size, init_method))
            elif not mpi:
                raise Skip("the ranks were not started by mpirun (plait-bench -n N --peers mpi does that)")
            else:
                from mpi4py import MPI

                peers.append(Mpi(MPI))
        except Skip as e:
            skipped[name] = str(e)
    return peers


def _run(args, argv, rank, size, local, mpi):
    import plait

    store, init_method, server = _rendezvous(mpi, rank)
    hosts = getattr(args, "hosts", 0)
    if hosts:  # the flat communicator first, on this one machine, then the simulated hosts'
        os.environ.pop("PLAIT_HOST_ID", None)
    comm = plait.init(rank, size, store=store, buffer_bytes=args.buffer_bytes)
    hier = _hier_comm(plait, rank, size, store, args.buffer_bytes, hosts) if hosts else None
    # Pinned only now: plait.init reads the affinity mask to decide whether ranks outnumber cores,
    # and a rank already pinned to one core would look oversubscribed to it.
    cpus = len(os.sched_getaffinity(0))
    core = None if args.no_pin else _pin(*local)
    skipped = dict(json.loads(os.environ.get(ENV_SKIPPED, "{}")))
    peers = _start_peers(args.peers, rank, size, init_method, mpi, skipped)
    cfg = harness.Config(
        sizes=args.sizes,
        dtype=args.dtype,
        op=args.op,
        root=args.root,
        placements=(IN,) if args.inplace else (OUT,) if args.outofplace else (OUT, IN),
        warmup=args.warmup,
        iters=args.iters,
        trials=args.trials,
        time_s=args.time,
        seed=args.seed,
    )
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"# plait-bench: {size} rank(s){' under mpirun' if mpi else ''}, plait {plait.__version__} "
        f"({_describe(plait.build_info())}), "
        f"{'rank 0 pinned to core %d' % core if core is not None else 'not pinned'}, "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    say(
        f"# {','.join(args.collectives)}; sizes {report.human(args.sizes[0])}..{report.human(args.sizes[-1])}"
        f" x{args.stepfactor}; {args.dtype}; op {args.op}; root {args.root}; {cfg.trials} trials of "
        + (f"{cfg.iters} iterations" if cfg.iters else f"~{cfg.time_s / cfg.trials * 1e3:.0f} ms")
        + f"; warm-up {cfg.warmup}; algorithm {args.algorithm}"
    )
    if hier is not None:
        say(
            f"# {hier.name}: plait over {hosts} simulated hosts (PLAIT_HOST_ID=sim<rank*{hosts}//{size}>), "
            f"{hier.comm.engine} between them: {hier.comm.layout.describe()}"
        )
    for p in args.peers:
        say(
            f"# peer {p}: "
            + (f"skipped: {skipped[p]}" if p in skipped else next(x.version for x in peers if x.name == p))
        )
    results, skips, summaries = [], [], []
    progress = _Progress(rank == 0, len(args.collectives) * len(args.sizes))
    for cname in args.collectives:
        impls, notes = plait_impls(comm, cname, args.algorithm, plait.algorithms(cname))
        impls += [hier] if hier is not None else []
        impls += [Plait(comm, shared=True)] if args.shared else []
        mine = _sweep(comm, COLLECTIVES[cname], impls + peers, cfg, notes, skips, progress, say)
        results += mine
        summaries.append(report.summary(cname, mine))
        for line in report.comparison(cname, mine):
            say(line)
    wrong = sum(r["wrong"] for r in results)
    say("#")
    for s in summaries:
        say(s)
    say(f"# #wrong total: {wrong}" + (" FAILED" if wrong else " OK"))
    say(report.avg_busbw(results), flush=True)
    if rank == 0:
        extra = {("torch" if p.name == "gloo" else p.name): p.version for p in peers}
        extra["affinity"] = cpus  # the mask the rank was given, before pinning
        _write_files(args, argv, results, skipped, skips, summaries, size, extra, cfg)
        if wrong:
            print(
                f"plait-bench: {wrong} wrong result elements: see the rows marked WRONG",
                file=sys.stderr,
                flush=True,
            )
    for p in reversed(peers):
        p.close()
    if hier is not None:
        hier.comm.finalize()
    comm.finalize()
    if server is not None:
        server.close()
    return 1 if wrong else 0


def _hier_comm(plait, rank, size, store, buffer_bytes, hosts):
    """The hierarchical contender: the same ranks as `hosts` simulated hosts of consecutive ranks."""
    from .peers import Plait

    if not 1 < hosts <= size:
        raise SystemExit(f"plait-bench: --hosts {hosts} needs 2..{size} (the number of ranks)")
    os.environ["PLAIT_HOST_ID"] = f"sim{rank * hosts // size}"
    c = plait.init(rank, size, store=store, buffer_bytes=buffer_bytes, set_default=False)
    return Plait(c, name=f"hier-{c.engine}")


def _sweep(comm, coll, impls, cfg, notes, skips, progress, say):
    """Measures one collective at every size, printing each size's rows as soon as it is done."""
    say(f"#\n# {coll.name}")
    for note in notes:
        say(f"# skipped: {note}")
    say(report.header(cfg.placements), flush=True)
    mine, seen = [], set()
    for nb in cfg.sizes:
        progress.step(coll.name, nb)
        recs, sk = harness.measure(comm, coll, nb, impls, cfg)
        progress.clear()
        mine += recs
        for impl, placement, why in sk:
            if (impl, placement) not in seen:
                seen.add((impl, placement))
                skips.append({"collective": coll.name, "impl": impl, "placement": placement, "reason": why})
                say(f"# {impl} {placement}: n/a: {why}")
        if recs:
            say("\n".join(report.rows(recs, cfg.placements)), flush=True)
    return mine


def _describe(build_info):
    info = dict(build_info)
    compiled, devices = info.pop("cuda", False), info.pop("cuda_devices", 0)
    gpu = f"compiled with CUDA, {devices} device{'s' * (devices != 1)}" if compiled else "CPU-only build"
    return ", ".join(
        [gpu]
        + [
            f"{k} " + ("/".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v))
            for k, v in info.items()
            if not (k.startswith("nccl") and v is None)
        ]
    )


def _write_files(args, argv, results, skipped, skips, summaries, size, extra, cfg):
    if args.json:
        config = {
            "nranks": size,
            "collectives": args.collectives,
            "sizes": args.sizes,
            "dtype": cfg.dtype,
            "op": cfg.op,
            "root": cfg.root,
            "algorithm": args.algorithm,
            "placements": list(cfg.placements),
            "warmup": cfg.warmup,
            "iters": cfg.iters,
            "trials": cfg.trials,
            "time_s": cfg.time_s,
            "seed": cfg.seed,
            "peers": args.peers,
            "buffer_bytes": args.buffer_bytes,
            "pinned": not args.no_pin,
        }
        skipped_list = [{"impl": k, "reason": v} for k, v in skipped.items()] + skips
        doc = report.document(argv, report.machine_info(extra), config, results, skipped_list, summaries)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"# wrote {args.json}")
    if args.plot:
        why = report.plot(args.plot, results)
        print(f"# plot: {why}" if why else f"# wrote {args.plot}", flush=True)


class _Progress:
    """A progress line on stderr: redrawn in place on a terminal; in a log, a line every 10 s."""

    def __init__(self, enabled, total):
        self.on, self.total, self.done = enabled, total, 0
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = self.last = time.monotonic()

    def step(self, coll, nbytes):
        if not self.on:
            return
        self.done += 1
        now = time.monotonic()
        msg = f"[plait-bench] {coll} {report.human(nbytes)} ({self.done}/{self.total}, {now - self.t0:.0f} s)"
        if self.tty:
            sys.stderr.write("\r" + msg + "\033[K")
            sys.stderr.flush()
        elif now - self.last >= 10:
            self.last = now
            print(msg, file=sys.stderr, flush=True)

    def clear(self):
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
