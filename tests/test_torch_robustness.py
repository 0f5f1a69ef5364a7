"""The native torch backend against calls that disagree across ranks, and a rank that dies while a
group is being created: every rank raises at once (never a wait for the group's deadline, whose
default is 30 minutes) with what each rank passed, and the group's own timeout bounds its creation."""

import os
import random
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import plait  # noqa: E402
import plait.torch  # noqa: E402,F401  (registers the backend)
from conftest import run_ranks  # noqa: E402
from plait import _shm  # noqa: E402
from plait.torch import _store as torch_store  # noqa: E402
from test_rendezvous_faults import _arm, _die  # noqa: E402,F401


def _world(rank, n, stamp):
    torch.set_num_threads(1)
    dist.init_process_group("plait", init_method="file://" + stamp + ".rdzv", rank=rank, world_size=n)


def _sparse(rank, n, addr, stamp):
    _world(rank, n, stamp)
    rows = 50 + 10 * rank  # every rank its own sparse size, the same nnz
    idx = torch.tensor([[0, 5, 40 + rank], [1, 2, 3]])
    t = torch.sparse_coo_tensor(idx, torch.ones(3), (rows, 8))
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        out = {"exc": None, "shape": list(t.shape)}
    except Exception as e:  # noqa: BLE001
        out = {"exc": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}
        out["mismatch"] = isinstance(e, plait.MismatchError)
    # the group is still usable, and equal sizes still sum exactly
    same = torch.sparse_coo_tensor(torch.tensor([[rank], [0]]), torch.tensor([float(rank + 1)]), (4, 2))
    dist.all_reduce(same)
    dense = same.to_dense()
    out["after"] = [dense[r, 0].item() for r in range(n)] + [dense.sum().item()]
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_sparse_sizes_differ_every_rank_raises(n, tmp_path):
    results = run_ranks(_sparse, n, timeout=90, args=(str(tmp_path / "w"),))
    for rank, res in enumerate(results):
        assert res["exc"] is not None, (rank, res)
        assert res["mismatch"], (rank, res)
        assert "(50, 8)" in res["msg"] and "(60, 8)" in res["msg"], res["msg"]
        assert res["s"] < 2.0, res
        assert res["after"] == [float(r + 1) for r in range(n)] + [float(n * (n + 1) // 2)], res


def _a2a(rank, n, addr, stamp, case):
    _world(rank, n, stamp)
    rows = 4 * n
    inp = torch.arange(rows, dtype=torch.float32) + 100 * rank
    out = torch.empty(rows)
    splits = None
    if case == "one_uneven" and rank == 1:
        splits = [1] * (n - 1) + [rows - (n - 1)]
    elif case == "disagree":
        splits = [2] * (n - 1) + [rows - 2 * (n - 1)] if rank == 0 else None
        splits = splits or [4] * n
    t0 = time.monotonic()
    try:
        dist.all_to_all_single(out, inp, output_split_sizes=splits, input_split_sizes=splits)
        res = {"exc": None}
    except Exception as e:  # noqa: BLE001
        res = {"exc": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}
        res["mismatch"] = isinstance(e, plait.MismatchError)
    return res


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", ["one_uneven", "disagree"])
def test_all_to_all_split_disagreement_raises_at_once(n, case, tmp_path):
    results = run_ranks(_a2a, n, timeout=90, args=(str(tmp_path / "w"), case))
    for rank, res in enumerate(results):
        assert res["exc"] is not None, (rank, res)
        assert res["mismatch"], (rank, res)
        assert res["s"] < 2.0, (rank, res)
        assert "splits" in res["msg"], res["msg"]
        assert "8100956935278297088" not in res["msg"], res["msg"]


def _a2a_uneven_ok(rank, n, addr, stamp):
    _world(rank, n, stamp)
    # rank r sends (j + 1) rows to rank j; so rank j receives j + 1 rows from every rank
    ins = [j + 1 for j in range(n)]
    outs = [rank + 1] * n
    inp = torch.cat([torch.full((j + 1,), float(100 * rank + j)) for j in range(n)])
    out = torch.empty(sum(outs))
    dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins)
    return out.tolist()


@pytest.mark.parametrize("n", [2, 3])
def test_all_to_all_uneven_splits_still_move_exact_data(n, tmp_path):
    results = run_ranks(_a2a_uneven_ok, n, timeout=90, args=(str(tmp_path / "w"),))
    for rank, got in enumerate(results):
        assert got == [float(100 * src + rank) for src in range(n) for _ in range(rank + 1)]


def _gather_sizes(rank, n, addr, stamp):
    _world(rank, n, stamp)
    inp = torch.zeros(4 + rank)
    outs = [torch.zeros(4) for _ in range(n)] if rank == 0 else None
    try:
        dist.gather(inp, outs, dst=0)
        return None
    except Exception as e:  # noqa: BLE001
        return str(e)


def test_internal_tag_is_not_printed(tmp_path):
    msgs = run_ranks(_gather_sizes, 2, timeout=90, args=(str(tmp_path / "w"),))
    assert any(msgs), msgs
    for m in msgs:
        if m:
            assert "8100956935278297088" not in m, m


def _new_group_dies(rank, n, addr, stamp, p):
    _world(rank, n, stamp)
    if rank == p["victim"]:
        _arm(p["point"], stamp + ".killed", torch_store.TorchStore)
    t0 = time.monotonic()
    try:
        g = dist.new_group(list(range(n)), timeout=timedelta(seconds=p["timeout"]))
        t = torch.ones(2)
        dist.all_reduce(t, group=g)
        return {"exc": None}
    except Exception as e:  # noqa: BLE001
        at = time.monotonic()
        return {
            "exc": type(e).__name__,
            "msg": str(e),
            "at": at,
            "t0": t0,
            "lost": isinstance(e, (plait.PeerLostError, plait.TimeoutError)),
        }


@pytest.mark.parametrize("seed", range(6), ids=lambda s: "seed%d" % s)
def test_rank_killed_while_a_group_is_created(seed, tmp_path):
    rng = random.Random(seed)
    n = 2 + seed % 2
    p = {"victim": rng.randrange(n), "point": ["arrived", "announced", "exchanged", "segment"][seed % 4]}
    p["timeout"] = 5.0
    stamp = str(tmp_path / "w")
    results = run_ranks(_new_group_dies, n, timeout=90, args=(stamp, p), may_die={p["victim"]})
    killed_at = float(open(stamp + ".killed").read())
    for rank, res in enumerate(results):
        if rank == p["victim"]:
            continue
        where = "plan %s, rank %d" % (p, rank)
        assert res["exc"] is not None, where
        assert res["lost"], "%s: %s: %s" % (where, res["exc"], res["msg"])
        if p["point"] == "arrived":  # the group's timeout, not 60 s or torch's 30 minutes
            assert res["at"] - res["t0"] < p["timeout"] + 2.0, "%s: %s" % (where, res["msg"])
            continue
        assert "rank %d" % p["victim"] in res["msg"], "%s: %s" % (where, res["msg"])
        assert res["at"] - killed_at < 2.0, "%s: %.2f s after the kill: %s" % (
            where,
            res["at"] - killed_at,
            res["msg"],
        )
    assert not [s for s in _shm.list_segments() if s.startswith("plait-%d-" % os.getpid())]


def _count_mismatch(rank, n, addr, stamp):
    _world(rank, n, stamp)
    try:
        dist.all_reduce(torch.ones(4 + rank))
        return None
    except Exception as e:  # noqa: BLE001
        return {"mismatch": isinstance(e, plait.MismatchError), "flight": getattr(e, "flight", None)}


def test_native_errors_carry_the_flight_report(tmp_path):
    for rank, res in enumerate(run_ranks(_count_mismatch, 2, timeout=90, args=(str(tmp_path / "w"),))):
        assert res is not None and res["mismatch"], (rank, res)
        flight = res["flight"]
        assert isinstance(flight, dict), (rank, flight)
        assert flight.get("rank") == rank, flight


def _bad_algo(rank, n, addr, stamp):
    if rank == n - 1:
        os.environ["PLAIT_ALGO"] = "allreduce=nonesuch"
    t0 = time.monotonic()
    try:
        _world(rank, n, stamp)
        return None
    except Exception as e:  # noqa: BLE001
        return {"msg": str(e), "s": time.monotonic() - t0, "invalid": isinstance(e, plait.InvalidArgument)}


@pytest.mark.parametrize("n", [2, 3])
def test_bad_setting_on_one_rank_fails_group_creation_everywhere(n, tmp_path):
    for rank, res in enumerate(run_ranks(_bad_algo, n, timeout=90, args=(str(tmp_path / "w"),))):
        assert res is not None and res["invalid"], (rank, res)
        assert "PLAIT_ALGO" in res["msg"] and "cannot open shared memory" not in res["msg"], res
        assert res["s"] < 5.0, (rank, res)
