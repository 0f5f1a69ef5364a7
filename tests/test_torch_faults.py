"""A rank SIGKILLed in the middle of DDP training over backend "plait": the survivors' training
step raises (a DistBackendError that is a plait.PeerLostError naming the dead rank) within 2 s,
nobody hangs, and /dev/shm is clean (run_ranks checks it). Seeded, so a failure replays."""

import os
import random
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import plait  # noqa: E402
import plait.torch  # noqa: E402,F401  (registers the backend)
from conftest import run_ranks  # noqa: E402

SEEDS = range(
    int(os.environ.get("PLAIT_TORCH_FAULT_SEED", 0)), int(os.environ.get("PLAIT_TORCH_FAULT_SEED", 0)) + 6
)


def _plan(seed):
    rng = random.Random(seed)
    n = rng.choice([2, 3])
    return {
        "seed": seed,
        "n": n,
        "victim": rng.randrange(n),
        "step": rng.randrange(1, 25),
        "where": rng.choice(["before_backward", "after_backward", "before_forward"]),
    }


def _train(rank, n, addr, p, stamp):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("plait", init_method="file://" + stamp + ".rdzv", rank=rank, world_size=n)
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)),
        bucket_cap_mb=0.002,
    )  # several buckets: the kill can land between two of them
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        for step in range(10_000):
            if step == p["step"] and rank == p["victim"] and p["where"] == "before_forward":
                _die(stamp)
            loss = model(torch.randn(8, 16)).square().mean()
            if step == p["step"] and rank == p["victim"] and p["where"] == "before_backward":
                _die(stamp)
            loss.backward()
            if step == p["step"] and rank == p["victim"] and p["where"] == "after_backward":
                _die(stamp)
            opt.step()
            opt.zero_grad()
        return {"exc": None}
    except Exception as e:  # noqa: BLE001 - the survivors' error is what the test checks
        # DDP's reducer re-raises a failed bucket as RuntimeError carrying plait's error text
        return {
            "exc": type(e).__name__,
            "msg": str(e),
            "at": time.time(),
            "plait": isinstance(e, plait.PeerLostError) or "PeerLostError" in str(e),
        }


def _die(stamp):
    with open(stamp, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), 9)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: "seed%d" % s)
def test_rank_killed_during_ddp_training(seed, tmp_path):
    p = _plan(seed)
    stamp = str(tmp_path / "killed_at")
    results = run_ranks(_train, p["n"], timeout=60, args=(p, stamp), may_die={p["victim"]})
    killed_at = float(open(stamp).read())
    for rank, res in enumerate(results):
        if rank == p["victim"]:
            continue
        where = "plan %s, rank %d" % (p, rank)
        assert res["exc"] is not None, "%s: training went on after the kill" % where
        assert res["plait"], "%s: %s: %s" % (where, res["exc"], res["msg"])
        assert "rank %d" % p["victim"] in res["msg"], "%s: %s" % (where, res["msg"])
        assert res["at"] - killed_at < 2.0, "%s: raised %.2f s after the kill" % (
            where,
            res["at"] - killed_at,
        )
