"""plait.horovod against the issue's targets, in one job: the cost of hvd.allreduce_ at 8 B and
4 MiB, a fused grouped allreduce of 100 small tensors against one plait allreduce of their total
size, and (with --synthetic) the synthetic benchmark's images/sec.

    plait-run -n 2 bench/horovod_bench.py [--rounds 5] [--synthetic] [--peer horovod] [--json out.json]

--peer horovod also runs every case on real Horovod (it must be importable as horovod.torch;
building it: bench/RESULTS-horovod.md). The bench then starts Horovod's gloo rendezvous server on
rank 0, as horovodrun would. Each round gives each implementation a turn, in alternating order:
init, every case, shutdown, so that the other one's background thread is not running meanwhile.
The table shows the ratio of the two medians. Results: bench/RESULTS-horovod.md.

Before each turn the bench times a plait-free probe of this VM's cross-core copies (rank 0 writes
4 MiB into a /dev/shm file mapping, rank 1 copies it out, numpy and a spin flag only). On the
2-core development VM it takes ~0.3 ms a round most of the time, and 2-8 ms in periods that last
seconds to minutes, whatever runs: the 4 MiB cases follow it. Each round's line shows the probe
beside the 4 MiB times, and the summary gives the medians of the rounds whose probes stayed fast.
"""

import argparse
import json
import mmap
import os
import socket
import statistics
import sys
import time

import numpy as np
import torch

import plait

PLAIT, HOROVOD = "plait.horovod", "horovod"
SYNTHETIC = "synthetic step, resnet18 batch 8 64x64"
BY_HAND = "4 MiB copy in, shm allreduce, scaled copy out"
GROUPED, DIRECT100 = "grouped_allreduce_ 100 x 1 KiB", "plait allreduce 100 KiB (direct)"


def _timed(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


PROBE_BYTES = 4 << 20
PROBE_FAST_US = 1000.0  # a round above this: the VM's slow cross-core mode (see the docstring)


def _cross_core_probe(direct, rounds=50):
    """Microseconds per round of a 4 MiB hand-off between ranks 0 and 1 through a shared file
    mapping, without plait (its barriers only bracket the timing). Other ranks just wait."""
    tag = torch.tensor([os.getpid()], dtype=torch.int64)
    direct.broadcast(tag, 0)
    path = f"/dev/shm/plait-bench-probe-{int(tag[0])}"
    if direct.rank == 0:
        with open(path, "wb") as f:
            f.truncate(PROBE_BYTES + 4096)
    direct.barrier()
    m = None
    if direct.rank < 2:
        fd = os.open(path, os.O_RDWR)
        m = mmap.mmap(fd, PROBE_BYTES + 4096)
        os.close(fd)
    direct.barrier()
    if direct.rank == 0:
        os.unlink(path)
    took = 0.0
    if m is not None:
        flag = np.frombuffer(m, np.int64, 1, PROBE_BYTES)
        buf = np.frombuffer(m, np.uint8, PROBE_BYTES)
        mine = np.ones(PROBE_BYTES, np.uint8)
        t0 = time.perf_counter()
        for i in range(rounds):
            if direct.rank == 0:
                while flag[0] != 2 * i:
                    pass
                np.copyto(buf, mine)
                flag[0] = 2 * i + 1
            else:
                while flag[0] != 2 * i + 1:
                    pass
                np.copyto(mine, buf)
                flag[0] = 2 * i + 2
        took = (time.perf_counter() - t0) / rounds * 1e6
        del flag, buf
        m.close()
    direct.barrier()
    return took


def _fast_cycles(impl):
    """plait.horovod's count of cycles its native fast path ran whole (None for Horovod)."""
    if impl != PLAIT:
        return None
    from plait.horovod.common import basics

    return basics.controller().fast_cycles


def _cases(hvd, direct):
    small = torch.ones(2)
    big = torch.ones(1 << 20)
    group = [torch.ones(256) for _ in range(100)]
    flat = torch.ones(256 * 100)
    cases = {
        "allreduce_ 8 B": (lambda: hvd.allreduce_(small, name="b8"), 2000),
        "allreduce_ 4 MiB": (lambda: hvd.allreduce_(big, name="b4m"), 40),
        GROUPED: (lambda: hvd.grouped_allreduce_(group, name="g100"), 200),
        "allreduce_ 100 KiB (one tensor)": (lambda: hvd.allreduce_(flat, name="b100k"), 200),
    }
    if direct is not None:  # plait only: the group's layout rebuilt every call (a cache miss)
        from plait.horovod.common import _fusion

        def regroup():
            _fusion.clear()
            hvd.grouped_allreduce_(group, name="g100")

        cases["grouped_allreduce_ 100 x 1 KiB, layout not kept"] = (regroup, 200)
        out, big_out = torch.empty_like(flat), torch.empty_like(big)
        cases[DIRECT100] = (lambda: direct.allreduce(flat, out), 200)
        cases["plait allreduce 4 MiB (direct)"] = (lambda: direct.allreduce(big, big_out), 40)
        cases["plait allreduce 8 B (direct)"] = (lambda: direct.allreduce(small, small), 2000)
        # what a 4 MiB allreduce_ (Average) does, without the coordinator: copy into a buffer in plait
        # shared memory, the in-place allreduce there, the 1/size scale on the copy out
        from plait import _shared

        shm = torch.from_numpy(_shared.empty(big.numel() * 4, "uint8")).view(torch.float32)

        def by_hand():
            shm.copy_(big)
            direct.allreduce(shm, shm)
            torch.mul(shm, 1.0 / direct.size, out=big)

        cases[BY_HAND] = (by_hand, 40)
    return cases


class _HorovodRendezvous:
    """Horovod's gloo rendezvous server on rank 0 and the environment horovodrun gives each rank."""

    def __init__(self, direct, rank, size):
        self.direct, self.rank, self.server = direct, rank, None
        host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        port = torch.zeros(1, dtype=torch.int64)
        if rank == 0:
            from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
            from horovod.runner.http.http_server import RendezvousServer

            self.plan = get_host_assignments(parse_hosts(f"{host}:{size}"), size)
            self.server = RendezvousServer()
            port[0] = self.server.start()
        direct.broadcast(port, 0)
        os.environ.update(
            HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
            HOROVOD_GLOO_RENDEZVOUS_PORT=str(int(port[0])),
            HOROVOD_CONTROLLER="gloo",
            HOROVOD_CPU_OPERATIONS="gloo",
            HOROVOD_GLOO_IFACE="lo",
            HOROVOD_HOSTNAME=host,
        )

    def reset(self):
        """A clean store for the next hvd.init() (the server keeps some keys of the last one)."""
        if self.server is not None:
            self.server.init(self.plan)
        self.direct.barrier()

    def stop(self):
        if self.server is not None:
            self.server.stop()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--peer", choices=[HOROVOD], default=None)
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--synthetic-steps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    direct = plait.init(set_default=False)  # the baseline: plait without the coordinator
    import plait.horovod.torch as phvd

    impls = {PLAIT: phvd}
    rdv = None
    if args.peer == HOROVOD:
        import horovod.torch as real

        impls[HOROVOD] = real
        rdv = _HorovodRendezvous(direct, direct.rank, direct.size)
    rank, size = direct.rank, direct.size
    times, fast, probes = {}, {}, {}
    for r in range(args.rounds):
        for impl in sorted(impls, reverse=bool(r % 2)):
            hvd = impls[impl]
            probes.setdefault(impl, []).append(_cross_core_probe(direct))
            if rdv is not None and impl == HOROVOD:
                rdv.reset()
            hvd.init()
            assert hvd.size() == size, f"{impl} started a world of {hvd.size()}, not {size}"
            for case, (fn, calls) in _cases(hvd, direct if impl == PLAIT else None).items():
                calls = calls if impl == PLAIT else max(2, calls // 20)
                direct.barrier()
                fn()
                fast0 = _fast_cycles(impl)
                times.setdefault((impl, case), []).append(_timed(fn, calls))
                if fast0 is not None:  # calls that ran the cached fast path whole, on this rank
                    fast.setdefault(case, []).append((_fast_cycles(impl) - fast0) / calls)
            if args.synthetic:
                direct.barrier()
                step = _synthetic_step(hvd, _model())  # a fresh model: hooks of one optimizer
                step()
                t = _timed(step, args.synthetic_steps)
                times.setdefault((impl, SYNTHETIC), []).append(t)
            direct.barrier()
            hvd.shutdown()
    if rdv is not None:
        rdv.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "ranks": size,
        "rounds": args.rounds,
        "load_avg_1min": os.getloadavg()[0],
        "median_s": {f"{i}: {c}": v for (i, c), v in med.items()},
    }
    res["probe_us"] = probes
    if rank == 0:
        print(f"# {size} ranks, median of {args.rounds} rounds, interleaved, load {os.getloadavg()}")
        _print_rounds(times, probes, args.rounds, res)
        for (impl, case), v in med.items():
            line = f"{impl:>14}  {case:<38} {v * 1e6:12.1f} us"
            if impl == HOROVOD:
                line += f"   plait.horovod/horovod = {med[(PLAIT, case)] / v:.4f}"
            print(line)
        ratio = med[(PLAIT, GROUPED)] / med[(PLAIT, DIRECT100)]
        print(f"grouped 100 x 1 KiB (fused) / one direct plait allreduce of 100 KiB = {ratio:.2f}")
        res["grouped_over_direct"] = ratio
        for case, shares in fast.items():
            if not case.startswith("plait allreduce") and case != BY_HAND:
                print(f"  cached fast path: {100 * statistics.median(shares):5.1f}% of {case}'s calls")
        one = med[(PLAIT, GROUPED)] / med[(PLAIT, "allreduce_ 100 KiB (one tensor)")]
        print(f"grouped 100 x 1 KiB (fused) / one plait.horovod allreduce_ of 100 KiB = {one:.2f}")
        res["grouped_over_one_tensor"] = one
        m4 = med[(PLAIT, "allreduce_ 4 MiB")]
        d4 = med[(PLAIT, "plait allreduce 4 MiB (direct)")]
        hand = med[(PLAIT, BY_HAND)]
        print(
            f"allreduce_ 4 MiB / direct plait allreduce 4 MiB = {m4 / d4:.3f}; / its copies and "
            f"allreduce by hand = {m4 / hand:.3f} ({(m4 - hand) * 1e6:+.1f} us: the coordinator)"
        )
        res["allreduce_4MiB_over_direct"] = m4 / d4
        res["allreduce_4MiB_over_by_hand"] = m4 / hand
        for impl in impls:
            if (impl, SYNTHETIC) in med:
                ips = 8 / med[(impl, SYNTHETIC)]
                res[f"{impl}: synthetic_img_per_s_per_rank"] = ips
                print(f"{impl:>14}  synthetic resnet18 (batch 8, 64x64, CPU): {ips:.2f} img/s per rank")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    direct.finalize()


def _print_rounds(times, probes, rounds, res):
    """Each round's 4 MiB times beside the cross-core probe taken before each turn, and the medians
    of the rounds in which every probe stayed fast."""
    big, direct4 = "allreduce_ 4 MiB", "plait allreduce 4 MiB (direct)"
    fast_rounds = [r for r in range(rounds) if max(p[r] for p in probes.values()) < PROBE_FAST_US]
    for r in range(rounds):
        line = f"  round {r}: probe " + " / ".join(f"{p[r]:.0f}" for p in probes.values()) + " us;"
        line += f" {PLAIT} 4 MiB {times[(PLAIT, big)][r] * 1e6:.0f} us,"
        line += f" direct {times[(PLAIT, direct4)][r] * 1e6:.0f} us"
        line += f"; grouped / direct 100 KiB {times[(PLAIT, GROUPED)][r] / times[(PLAIT, DIRECT100)][r]:.2f}"
        if (HOROVOD, big) in times:
            h = times[(HOROVOD, big)][r]
            line += f", {HOROVOD} {h * 1e6:.0f} us, ratio {times[(PLAIT, big)][r] / h:.3f}"
        print(line + ("" if r in fast_rounds else "  (slow cross-core mode)"))
    res["fast_probe_rounds"] = fast_rounds
    if fast_rounds:
        g = statistics.median(times[(PLAIT, GROUPED)][r] / times[(PLAIT, DIRECT100)][r] for r in fast_rounds)
        res["grouped_over_direct_fast_probe_rounds"] = g
        print(f"grouped / direct 100 KiB, {len(fast_rounds)} round(s) with fast probes: median {g:.2f}")
    if fast_rounds and (HOROVOD, big) in times:
        ratio = statistics.median(times[(PLAIT, big)][r] / times[(HOROVOD, big)][r] for r in fast_rounds)
        res["allreduce_4MiB_ratio_fast_probe_rounds"] = ratio
        print(f"allreduce_ 4 MiB, {len(fast_rounds)} round(s) with fast probes: median ratio {ratio:.3f}")


def _model():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "horovod"))
    import _models

    torch.manual_seed(0)
    return _models.resnet18()


def _synthetic_step(hvd, model):
    """The synthetic benchmark's training step (SGD through hvd.DistributedOptimizer)."""
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data, target = torch.randn(8, 3, 64, 64), torch.randint(0, 1000, (8,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        opt.step()

    return step


if __name__ == "__main__":
    main()
