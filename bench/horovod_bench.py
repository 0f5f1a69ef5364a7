"""plait.horovod against the issue's targets, in one job: the cost of hvd.allreduce_ at 8 B and
4 MiB, a fused grouped allreduce of 100 small tensors against one plait allreduce of their total
size, and (with --synthetic) the synthetic benchmark's images/sec.

    plait-run -n 2 bench/horovod_bench.py [--rounds 7] [--synthetic] [--json out.json]

With real Horovod importable (`import horovod.torch`; building it: bench/RESULTS-horovod.md) pass
--peer horovod: every measurement then also runs on Horovod, interleaved with plait's, and the
table shows their ratio. Results: bench/RESULTS-horovod.md.
"""

import argparse
import json
import statistics
import time

import torch

import plait


def _timed(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _cases(hvd, direct):
    small = torch.ones(2)
    big = torch.ones(1 << 20)
    group = [torch.ones(256) for _ in range(100)]
    flat = torch.ones(256 * 100)
    cases = {
        "allreduce_ 8 B": (lambda: hvd.allreduce_(small, name="b8"), 2000),
        "allreduce_ 4 MiB": (lambda: hvd.allreduce_(big, name="b4m"), 40),
        "grouped_allreduce_ 100 x 1 KiB": (lambda: hvd.grouped_allreduce_(group, name="g100"), 200),
        "allreduce_ 100 KiB (one tensor)": (lambda: hvd.allreduce_(flat, name="b100k"), 200),
    }
    if direct is not None:
        out = torch.empty_like(flat)
        cases["plait allreduce 100 KiB (direct)"] = (lambda: direct.allreduce(flat, out), 200)
        cases["plait allreduce 8 B (direct)"] = (lambda: direct.allreduce(small, small), 2000)
    return cases


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--peer", choices=["horovod"], default=None)
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    direct = plait.init(set_default=False)  # the baseline: plait without the coordinator
    import plait.horovod.torch as phvd

    impls = {"plait.horovod": phvd}
    if args.peer == "horovod":
        import horovod.torch as real

        impls["horovod"] = real
    for h in impls.values():
        h.init()
    rank = phvd.rank()
    cases = {name: _cases(h, direct if name == "plait.horovod" else None) for name, h in impls.items()}
    times = {(i, c): [] for i in cases for c in cases[i]}
    for r in range(args.rounds):
        for impl in sorted(cases, reverse=bool(r % 2)):
            for case, (fn, calls) in cases[impl].items():
                calls = calls if impl == "plait.horovod" else max(2, calls // 20)
                direct.barrier()
                fn()
                times[(impl, case)].append(_timed(fn, calls))
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"ranks": phvd.size(), "median_s": {f"{i}: {c}": v for (i, c), v in med.items()}}
    if args.synthetic:
        res["synthetic_img_per_s"] = _synthetic(phvd)
    if rank == 0:
        print(f"# {phvd.size()} ranks, median of {args.rounds} rounds, interleaved")
        for (impl, case), v in med.items():
            line = f"{impl:>14}  {case:<34} {v * 1e6:12.1f} us"
            if impl == "horovod":
                line += f"   plait.horovod/horovod = {med[('plait.horovod', case)] / v:.3f}"
            print(line)
        ratio = (
            med[("plait.horovod", "grouped_allreduce_ 100 x 1 KiB")]
            / med[("plait.horovod", "plait allreduce 100 KiB (direct)")]
        )
        print(f"grouped 100 x 1 KiB (fused) / one direct plait allreduce of 100 KiB = {ratio:.2f}")
        res["grouped_over_direct"] = ratio
        if "synthetic_img_per_s" in res:
            print(
                f"synthetic resnet18 (batch 8, 64x64, CPU): {res['synthetic_img_per_s']:.2f} img/s per rank"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    for h in impls.values():
        h.shutdown()
    direct.finalize()


def _synthetic(hvd):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "horovod"))
    import _models

    torch.manual_seed(0)
    model = _models.resnet18()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data, target = torch.randn(8, 3, 64, 64), torch.randint(0, 1000, (8,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        opt.step()

    step()
    return 8 * 5 / (_timed(step, 5) * 5)


if __name__ == "__main__":
    main()
