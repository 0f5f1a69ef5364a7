"""Cross-host send/recv latency of plait's numpy multi-host communicator against torch's gloo.

    plait-run -n 2 python bench/hier_p2p.py     # 2 simulated hosts x 1 rank (PLAIT_HOST_ID)

With --exchange it times an exchange instead (both ranks post a receive, send, then wait: what
a pipeline stage does with a neighbour; torch's irecv + send + wait for gloo).

Rank 0 and rank 1 sit on two simulated hosts, so plait's send/recv go through the gloo engine
(csrc/torch/gloo_engine.cc: a header on a reserved tag, the payload inline up to 240 bytes or
after it). For each size it times a ping-pong (0 sends, 1 receives and sends back) with plait and
with a flat gloo process group's send/recv, batches alternating so drift hits both alike, and
prints on rank 0 the median batch's one-way time (round trip / 2) of each and the ratio. Every
size's last pong is checked against its closed form (rank 1 adds 1 to every element).
"""

import argparse
import os
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,1048576", help="bytes, comma separated")
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per timed batch (sets iterations)")
    ap.add_argument(
        "--exchange",
        action="store_true",
        help="time an exchange instead: both ranks post a receive, send, then wait (irecv + send)",
    )
    a = ap.parse_args(argv)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if n != 2:
        raise SystemExit("run with 2 ranks (plait-run -n 2)")
    os.environ["PLAIT_HOST_ID"] = f"bench-host{rank}"

    import torch
    import torch.distributed as dist

    import plait

    comm = plait.init(timeout=120)
    dist.init_process_group("gloo")
    peer = 1 - rank
    rows = []
    for size in (int(s) for s in a.sizes.split(",")):
        x = np.arange(max(1, size // 4), dtype=np.int32)
        t = torch.from_numpy(x.copy())

        def plait_pp(x=x):
            if rank == 0:
                comm.send(x, peer)
                comm.recv(x, peer)
            else:
                comm.recv(x, peer)
                np.add(x, 1, out=x)
                comm.send(x, peer)

        def gloo_pp(t=t):
            if rank == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)

        mine = x + 1000 * rank
        got, tgot = np.zeros_like(x), torch.zeros(x.size, dtype=torch.int32)

        def plait_ex(got=got, mine=mine):
            h = comm.recv(got, peer, async_op=True)
            comm.send(mine, peer)
            h.wait()

        tmine = torch.from_numpy(mine.copy())

        def gloo_ex(tgot=tgot, tmine=tmine):
            w = dist.irecv(tgot, peer)
            dist.send(tmine, peer)
            w.wait()

        calls = {"plait": plait_ex, "gloo": gloo_ex} if a.exchange else {"plait": plait_pp, "gloo": gloo_pp}
        for fn in calls.values():
            for _ in range(3):
                fn()
        t0 = time.perf_counter()
        calls["gloo"]()
        iters = np.array([max(3, min(5000, int(a.budget / max(time.perf_counter() - t0, 1e-6))))])
        comm.broadcast(iters, 0)
        iters = int(iters[0])
        times = {k: [] for k in calls}
        for _ in range(a.batches):
            for k, fn in calls.items():
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[k].append((time.perf_counter() - t0) / iters / (1 if a.exchange else 2) * 1e6)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        if a.exchange:  # what the peer sent, through plait and through gloo
            want = np.arange(x.size, dtype=np.int32) + 1000 * peer
            wrong = int((got != want).sum() + (tgot.numpy() != want).sum())
        else:  # 3 + iters * batches pongs so far: each added 1 on rank 1
            done = 3 + iters * a.batches
            wrong = int((x != np.arange(x.size, dtype=np.int32) + done).sum()) if rank == 0 else 0
        rows.append((size, med, iters, wrong))
    if rank == 0:
        what = (
            "one exchange (irecv + send + wait, both ranks)"
            if a.exchange
            else "one-way send/recv time (ping-pong / 2)"
        )
        print(f"# 2 ranks on 2 simulated hosts: {what}, median batch")
        print("| bytes | iters | plait (us) | gloo (us) | plait / gloo | #wrong |")
        print("|---:|---:|---:|---:|---:|---:|")
        for size, med, iters, wrong in rows:
            print(
                f"| {size} | {iters} | {med['plait']:.1f} | {med['gloo']:.1f} | "
                f"{med['plait'] / med['gloo']:.2f} | {wrong} |"
            )
    comm.barrier()
    dist.destroy_process_group()
    comm.finalize()


if __name__ == "__main__":
    main()
