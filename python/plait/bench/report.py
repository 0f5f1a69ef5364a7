"""What rank 0 prints and writes: nccl-tests' table (one row per size and implementation), the
peer comparison, the closing summary, the JSON file and the plot."""

import datetime
import os
import platform
import sys

from .peers import IN, OUT, SHARED

SCHEMA = "plait-bench/1"
RECORD_KEYS = (
    "collective",
    "impl",
    "algorithm",
    "placement",
    "bytes",
    "count",
    "dtype",
    "op",
    "root",
    "nranks",
    "time_us",
    "trials_us",
    "iters",
    "algbw_GBps",
    "busbw_GBps",
    "wrong",
)
JSON_KEYS = ("schema", "date", "command", "machine", "config", "results", "skipped", "summary")
_LEFT = "%12s  %12s  %8s  %6s  %6s  %-16s"
_CELL = "  %8s  %7s  %7s  %6s"


def human(nbytes):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def fmt_time(us):
    # nccl-tests' widths: fewer decimals as the number grows, so columns stay aligned
    return "%.0f" % us if us >= 10000 else "%.1f" % us if us >= 100 else "%.2f" % us


def header(placements):
    top = " " * 70 + "".join(p.center(36) for p in placements)
    names = _LEFT % ("size", "count", "type", "redop", "root", "impl")
    units = _LEFT % ("(B)", "(elements)", "", "", "", "")
    names += "".join(_CELL % ("time", "algbw", "busbw", "#wrong") for _ in placements)
    units += "".join(_CELL % ("(us)", "(GB/s)", "(GB/s)", "") for _ in placements)
    return "\n".join("#" + line[1:] for line in (top, names, units))


def rows(records, placements):
    """Table lines for one size: one per implementation, its placements side by side."""
    by_impl = {}
    for r in records:
        by_impl.setdefault(r["impl"], {})[r["placement"]] = r
    lines = []
    for impl, cells in by_impl.items():
        r0 = next(iter(cells.values()))
        line = _LEFT % (r0["bytes"], r0["count"], r0["dtype"], r0["op"], r0["root"], impl)
        for p in placements:
            r = cells.get(p)
            line += (
                _CELL % ("n/a", "n/a", "n/a", "n/a")
                if r is None
                else _CELL
                % (fmt_time(r["time_us"]), "%.2f" % r["algbw_GBps"], "%.2f" % r["busbw_GBps"], r["wrong"])
            )
        lines.append(line + ("   <-- WRONG" if any(r["wrong"] for r in cells.values()) else ""))
    return lines


def best_times(records):
    """{(bytes, impl): fastest median over the placements it ran}."""
    best = {}
    for r in records:
        k = (r["bytes"], r["impl"])
        best[k] = min(best.get(k, float("inf")), r["time_us"])
    return best


def comparison(coll, records):
    """Lines of the side-by-side table: every implementation's time, then plait/peer ratios."""
    best = best_times(records)
    impls = list(dict.fromkeys(r["impl"] for r in records))
    peers = [i for i in impls if not i.startswith("plait")]
    if len(impls) < 2:
        return []
    refs = [("plait", None)] + ([("shared", SHARED)] if SHARED in impls else [])
    cols = [(f"{tag}/{p}", key, p) for tag, key in refs for p in peers]
    lines = [
        f"# {coll}: time (us), each implementation at its faster of {OUT}/{IN}; "
        f"plait/peer = plait (auto) time / peer time"
        + (f", shared/peer = {SHARED} time / peer time" if len(refs) > 1 else "")
        + ", < 1: plait faster",
        "#"
        + ("%11s" % "size")
        + "".join(" %*s" % (max(14, len(i)), i) for i in impls)
        + "".join(" %*s" % (max(12, len(c)), c) for c, _, _ in cols),
    ]
    for nb in sorted({k[0] for k in best}):
        line = "#%11s" % human(nb) + "".join(
            " %*s" % (max(14, len(i)), fmt_time(best[(nb, i)]) if (nb, i) in best else "-") for i in impls
        )
        for c, key, p in cols:
            ref = _plait_ref(best, nb) if key is None else best.get((nb, key))
            ok = ref is not None and (nb, p) in best and best[(nb, p)] > 0
            line += " %*s" % (max(12, len(c)), "%.3g" % (ref / best[(nb, p)]) if ok else "-")
        lines.append(line)
    return lines


def _plait_ref(best, nb):
    if (nb, "plait") in best:
        return best[(nb, "plait")]
    mine = [t for (b, i), t in best.items() if b == nb and i.startswith("plait") and i != SHARED]
    return min(mine) if mine else None


def _winners(best, sizes, algos):
    """The fastest algorithm at each size. The previous winner stays while within 5% (noise), so
    that crossovers are real changes rather than coin flips between equals."""
    winners = []
    for nb in sizes:
        w = min(algos, key=lambda a: best.get((nb, a), float("inf")))
        if winners and best.get((nb, winners[-1]), float("inf")) <= 1.05 * best.get((nb, w), 0):
            w = winners[-1]
        winners.append(w)
    return winners


def _algorithm_parts(best, sizes, algos):
    runs, cross = [], []  # runs: [algorithm, first size, last size]
    for nb, w in zip(sizes, _winners(best, sizes, algos)):
        if runs and runs[-1][0] == w:
            runs[-1][2] = nb
            continue
        if runs:
            cross.append(f"{runs[-1][0][6:]}->{w[6:]} at {human(nb)}")
        runs.append([w, nb, nb])
    parts = [
        "best " + ", ".join(f"{w[6:]} {human(a)}..{human(b)}" for w, a, b in runs),
        "crossovers " + (", ".join(cross) if cross else "none"),
    ]
    fastest = {nb: min(best.get((nb, a), float("inf")) for a in algos) for nb in sizes}
    auto = [
        (best[(nb, "plait")] / fastest[nb], nb)
        for nb in sizes
        if (nb, "plait") in best and fastest[nb] < float("inf")
    ]
    if auto:
        worst = max(auto)
        parts.append(
            f"auto within 10% of the best at {sum(q <= 1.1 for q, _ in auto)}/{len(auto)} sizes"
            + (f" (worst {worst[0]:.2f}x at {human(worst[1])})" if worst[0] > 1.1 else "")
        )
    return parts


def summary(coll, records):
    """One line: best plait algorithm per size, the crossovers, how auto fares, ratios to peers."""
    best = best_times(records)
    sizes = sorted({k[0] for k in best})
    algos = sorted({i for (_, i) in best if i.startswith("plait:")})
    parts = _algorithm_parts(best, sizes, algos) if algos else []
    mine = [(nb, best[(nb, "plait")]) for nb in sizes if (nb, "plait") in best]
    if not algos and mine:
        bw = max(r["busbw_GBps"] for r in records if r["impl"] == "plait")
        parts.append(f"plait {fmt_time(mine[0][1])} us at {human(mine[0][0])}, peak busbw {bw:.2f} GB/s")
    for p in sorted({i for (_, i) in best if not i.startswith("plait")}):
        q = [
            _plait_ref(best, nb) / best[(nb, p)]
            for nb in sizes
            if (nb, p) in best and _plait_ref(best, nb) is not None and best[(nb, p)] > 0
        ]
        if q:
            parts.append(f"plait/{p} {min(q):.3g}x..{max(q):.3g}x")
        q = [
            best[(nb, SHARED)] / best[(nb, p)]
            for nb in sizes
            if (nb, p) in best and (nb, SHARED) in best and best[(nb, p)] > 0
        ]
        if q:
            parts.append(f"shared/{p} {min(q):.3g}x..{max(q):.3g}x")
    return f"# summary {coll}: " + ("; ".join(parts) if parts else "nothing measured")


def avg_busbw(results):
    """nccl-tests' closing line: the mean bus bandwidth over plait's rows (auto where measured, else
    every plait algorithm), every size, collective and placement of the run."""
    mine = [r for r in results if r["impl"] == "plait"] or [
        r for r in results if r["impl"].startswith("plait") and r["impl"] != SHARED
    ]
    if not mine:
        return "# Avg bus bandwidth    : n/a (no plait rows)"
    avg = sum(r["busbw_GBps"] for r in mine) / len(mine)
    return f"# Avg bus bandwidth    : {avg:.6g} GB/s (plait, mean of {len(mine)} rows)"


def machine_info(extra=None):
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import numpy
    import plait

    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "loadavg": _loadavg(),
        "numpy": numpy.__version__,
        "plait": plait.__version__,
        "build_info": plait.build_info(),
    }
    info.update(extra or {})
    return info


def _loadavg():
    """1-minute load average: other work on a 2-core VM is the main source of noise."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def document(argv, machine, config, results, skipped, summaries):
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {
        "schema": SCHEMA,
        "date": now,
        "command": ["plait-bench", *argv],
        "machine": machine,
        "config": config,
        "results": results,
        "skipped": skipped,
        "summary": summaries,
    }


def plot(path, results):
    """busbw and latency vs size, one line per implementation; one row of panels per collective."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot written"
    colls = list(dict.fromkeys(r["collective"] for r in results))
    fig, axes = plt.subplots(len(colls), 2, figsize=(11, 3.6 * len(colls)), squeeze=False)
    for row, coll in zip(axes, colls):
        mine = [r for r in results if r["collective"] == coll]
        best = best_times(mine)
        for impl in dict.fromkeys(r["impl"] for r in mine):
            pts = sorted((nb, t) for (nb, i), t in best.items() if i == impl)
            xs = [nb for nb, _ in pts]
            factor = next(r["busbw_GBps"] / r["algbw_GBps"] for r in mine if r["impl"] == impl)
            row[0].plot(xs, [nb / t / 1e3 * factor for nb, t in pts], marker=".", label=impl)
            row[1].plot(xs, [t for _, t in pts], marker=".", label=impl)
        for ax, what in zip(row, ("busbw (GB/s)", "time (us)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("size (B)")
            ax.set_ylabel(what)
            ax.set_title(f"{coll}: {what.split()[0]}")
            ax.grid(True, alpha=0.3)
        row[1].set_yscale("log")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None
