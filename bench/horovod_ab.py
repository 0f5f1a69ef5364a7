"""plait.horovod against an older plait.horovod in the same job: before/after numbers that one
noisy machine can still compare (each round runs both, in alternating order).

    git archive <commit> python/plait/horovod | tar -x -C /tmp/base
    plait-run -n 2 bench/horovod_ab.py --baseline /tmp/base/python/plait/horovod [--rounds 5]

The baseline package is loaded under another name (its imports are relative, so it runs on the
installed plait core); the installed plait.horovod is "new". Cases: allreduce_ of 8 B and 4 MiB,
grouped_allreduce_ of 100 x 1 KiB, allreduce_ of 100 KiB, and plait's direct allreduce of 100 KiB
and 4 MiB for the ratios the issue asks for. With --numpy, the new package also runs a turn with
PLAIT_HOROVOD_NATIVE=0 ("numpy": its path where plait's native torch module cannot be built).
"""

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time

import torch

import plait


def _load(path, name="horovod_baseline"):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(path, "__init__.py"), submodule_search_locations=[path]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module(name + ".torch")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", required=True, help="directory of an older plait/horovod package")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--cpu",
        action="store_true",
        help="time the calling thread's CPU instead of the wall clock (steadier on a loaded machine; "
        "with 2+ ranks it includes spinning in plait's collectives while waiting for a peer)",
    )
    p.add_argument("--numpy", action="store_true", help="also time the new package without its native copies")
    args = p.parse_args()
    direct = plait.init(set_default=False)
    impls = {
        "old": _load(os.path.abspath(args.baseline)),
        "new": importlib.import_module("plait.horovod.torch"),
    }
    if args.numpy:
        impls["numpy"] = impls["new"]
    small, big = torch.ones(2), torch.ones(1 << 20)
    group, flat = [torch.ones(256) for _ in range(100)], torch.ones(256 * 100)
    out, big_out = torch.empty_like(flat), torch.empty_like(big)

    clock = time.thread_time if args.cpu else time.perf_counter

    def timed(fn, calls):
        fn()
        direct.barrier()
        t0 = clock()
        for _ in range(calls):
            fn()
        return (clock() - t0) / calls

    times = {}
    for r in range(args.rounds):
        order = list(impls) if r % 2 else list(impls)[::-1]
        for name in order:
            hvd = impls[name]
            os.environ["PLAIT_HOROVOD_NATIVE"] = "0" if name == "numpy" else "1"
            hvd.init()
            cases = {
                "allreduce_ 8 B": (lambda h=hvd: h.allreduce_(small, name="b8"), 1000),
                "allreduce_ 4 MiB": (lambda h=hvd: h.allreduce_(big, name="b4m"), 30),
                "grouped_allreduce_ 100 x 1 KiB": (
                    lambda h=hvd: h.grouped_allreduce_(group, name="g100"),
                    300,
                ),
                "allreduce_ 100 KiB": (lambda h=hvd: h.allreduce_(flat, name="b100k"), 300),
            }
            for case, (fn, calls) in cases.items():
                times.setdefault((name, case), []).append(timed(fn, calls))
            hvd.shutdown()
        times.setdefault(("direct", "100 KiB"), []).append(timed(lambda: direct.allreduce(flat, out), 300))
        times.setdefault(("direct", "4 MiB"), []).append(timed(lambda: direct.allreduce(big, big_out), 30))
    med = {k: statistics.median(v) for k, v in times.items()}
    if direct.rank == 0:
        what = "thread CPU" if args.cpu else "wall"
        print(
            f"# {direct.size} ranks, {what} per call, median of {args.rounds} rounds, load {os.getloadavg()}"
        )
        for (impl, case), v in med.items():
            print(f"{impl:>7}  {case:<32} {v * 1e6:10.1f} us")
        for impl in impls:
            g = med[(impl, "grouped_allreduce_ 100 x 1 KiB")] / med[("direct", "100 KiB")]
            m = med[(impl, "allreduce_ 4 MiB")] / med[("direct", "4 MiB")]
            print(f"{impl}: grouped / direct 100 KiB = {g:.2f}; allreduce_ 4 MiB / direct 4 MiB = {m:.3f}")
        for case in (
            "allreduce_ 8 B",
            "allreduce_ 4 MiB",
            "grouped_allreduce_ 100 x 1 KiB",
            "allreduce_ 100 KiB",
        ):
            for impl in list(impls)[1:]:
                print(f"{impl + ' / old':>11}  {case:<32} {med[(impl, case)] / med[('old', case)]:.3f}")
    direct.finalize()


if __name__ == "__main__":
    main()
