"""plait-bench: its arithmetic (sizes, counts, busbw factors), its result check (it must catch a
wrong result), its JSON, and one short CLI run with 2 ranks. No test asserts a timing."""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import plait
from plait import _store
from plait.bench import cli, harness, peers, report
from plait.bench.collectives import COLLECTIVES, DTYPES, OPS, Data, count_wrong, itemsize

_ROOT = os.path.dirname(list(plait.__path__)[0])  # the ranks must import this same plait
_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
for _k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PLAIT_STORE", "OMPI_COMM_WORLD_SIZE"):
    _ENV.pop(_k, None)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("8", 8),
        ("1K", 1024),
        ("1k", 1024),
        ("64M", 64 << 20),
        ("1G", 1 << 30),
        ("4MiB", 4 << 20),
        ("2KB", 2048),
        ("1.5K", 1536),
    ],
)
def test_parse_size(text, expected):
    assert cli.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "K", "1X", "-8", "1 M B"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_size(text)


def test_sizes():
    assert cli.sizes(8, 64, 2) == [8, 16, 32, 64]
    assert cli.sizes(8, 100, 4) == [8, 32]
    assert cli.sizes(64, 64, 1) == [64]
    with pytest.raises(ValueError):
        cli.sizes(8, 64, 1)
    with pytest.raises(ValueError):
        cli.sizes(64, 8, 2)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_busbw_factors(n):
    f = {c: COLLECTIVES[c].busbw_factor(n) for c in COLLECTIVES}
    assert f["allreduce"] == pytest.approx(2 * (n - 1) / n)
    for c in ("reduce_scatter", "allgather", "alltoall"):
        assert f[c] == pytest.approx((n - 1) / n)
    assert f["broadcast"] == f["reduce"] == 1.0


def test_counts_follow_nccl_tests():
    ar, rs, ag, a2a = (COLLECTIVES[c] for c in ("allreduce", "reduce_scatter", "allgather", "alltoall"))
    assert ar.count(1024, "float32", 3) == 256
    # size is the whole buffer; blocked collectives round down to n equal blocks
    assert rs.count(1024, "float32", 3) == 255
    assert rs.recv_count(255, 3) == 85 and rs.send_count(255, 3) == 255
    assert ag.count(1024, "float32", 4) == 256
    assert ag.send_count(256, 4) == 64 and ag.recv_count(256, 4) == 256
    assert a2a.count(1024, "float64", 4) == 128 and a2a.recv_count(128, 4) == 128
    assert rs.count(8, "float32", 4) == 0  # 2 elements cannot make 4 blocks: the size is skipped
    assert itemsize("bfloat16") == 2 and itemsize("bool") == 1


def _simulate(coll, data, count, root):
    """Every rank's result computed directly from every rank's input with numpy."""
    n = data.n
    ins = [data.encode(coll.input(data, r, count)).astype(np.float64) for r in range(n)]
    if data.dtype == "bfloat16":  # bits -> value
        ins = [(i.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for i in ins]
    op = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}.get(data.op)
    if data.dtype == "bool":
        op = np.max if data.op in ("sum", "max") else np.min
    red = (lambda s: np.sum(s, 0) / n) if data.op == "avg" else (lambda s: op(s, 0))
    m = count // n
    out = []
    for r in range(n):
        if coll.name == "allreduce":
            out.append(red(np.stack(ins)))
        elif coll.name == "reduce_scatter":
            out.append(red(np.stack(ins))[r * m : (r + 1) * m])
        elif coll.name == "allgather":
            out.append(np.concatenate(ins))
        elif coll.name == "broadcast":
            out.append(ins[root])
        elif coll.name == "reduce":
            out.append(red(np.stack(ins)) if r == root else None)
        else:
            out.append(np.concatenate([ins[j][r * m : (r + 1) * m] for j in range(n)]))
    return out


def _decode(data, a):
    if data.dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


@pytest.mark.parametrize(
    "dtype,op", [(d, o) for d in DTYPES for o in OPS if o != "avg" or d.startswith(("float", "bfloat"))]
)
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_expected_matches_direct_computation(dtype, op, n):
    for coll in COLLECTIVES.values():
        data = Data(dtype, op if coll.reduces else "sum", n, seed=3)
        count = coll.count(4096, dtype, n)
        root = n - 1
        want = _simulate(coll, data, count, root)
        for r in range(n):
            exp = coll.expected(data, r, count, root)
            if want[r] is None:
                assert exp is None
                continue
            enc = data.encode(exp)
            if dtype.startswith("int") or dtype == "uint8":  # wrap-around, as numpy and plait wrap
                assert np.array_equal(enc, want[r].astype(np.int64).astype(enc.dtype)), (coll.name, r)
            else:
                assert np.array_equal(_decode(data, enc), want[r]), (coll.name, r)
        vals = data.values(0, 0, count)
        assert vals.min() >= 1 and len(np.unique(vals)) > 1 or data.k == 1  # non-zero, not constant


def test_count_wrong_detects_a_wrong_element():
    data = Data("float32", "sum", 4, seed=1)
    exp = data.encode(COLLECTIVES["allreduce"].expected(data, 0, 1000, 0))
    got = exp.copy()
    assert count_wrong(got, exp) == 0
    got[17] += 1
    got[999] = 0
    assert count_wrong(got, exp) == 2


class _OneRank:
    """Stands in for a 1-rank communicator: allreduce over one rank is a copy."""

    rank, size = 0, 1

    def allreduce(self, x, out, op="sum"):
        np.copyto(out, x)

    def barrier(self):
        pass


class _Copy:
    """A 1-rank allreduce done right (copy) or wrong (copy plus one, or nothing at all)."""

    def __init__(self, mode):
        self.name, self.mode = f"fake:{mode}", mode

    def supports(self, coll, dtype, op, inplace):
        return None

    def prepare(self, coll, x, out, dtype, op, root):
        if self.mode == "right":
            return lambda: np.copyto(out, x) if out is not x else None
        if self.mode == "plus_one":
            return lambda: np.copyto(out, x + 1)
        return lambda: None


def test_harness_checks_before_timing():
    cfg = harness.Config(sizes=[4096], time_s=0.01, trials=3)
    impls = [_Copy("right"), _Copy("plus_one"), _Copy("nothing")]
    recs, skips = harness.measure(_OneRank(), COLLECTIVES["allreduce"], 4096, impls, cfg)
    assert not skips
    wrong = {(r["impl"], r["placement"]): r["wrong"] for r in recs}
    assert wrong[("fake:right", peers.OUT)] == wrong[("fake:right", peers.IN)] == 0
    assert wrong[("fake:plus_one", peers.OUT)] == wrong[("fake:plus_one", peers.IN)] == 1024
    # Writing nothing must not pass on the previous implementation's correct output.
    assert wrong[("fake:nothing", peers.OUT)] == 1024
    for r in recs:
        assert set(r) == set(report.RECORD_KEYS)
        assert len(r["trials_us"]) == 3 and 1 <= r["iters"] <= harness.MAX_ITERS
        assert r["bytes"] == 4096 and r["count"] == 1024
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 0.0)  # 2(n-1)/n = 0 at n = 1
    assert any("WRONG" in line for line in report.rows(recs, cfg.placements))


def test_iterations_budget():
    cfg = harness.Config(sizes=[8], time_s=0.2, trials=5)
    assert harness.iterations(cfg, 1e-7) == harness.MAX_ITERS
    assert harness.iterations(cfg, 1.0) == 1
    assert harness.iterations(cfg, 1e-3) == 40
    assert harness.iterations(harness.Config(sizes=[8], iters=7), 1.0) == 7


def test_summary_names_best_and_crossovers():
    recs = []
    for nb, times in (
        (8, {"plait": 2, "plait:a": 1, "plait:b": 5, "mpi": 4}),
        (1024, {"plait": 9, "plait:a": 8, "plait:b": 3, "mpi": 6}),
    ):
        for impl, t in times.items():
            recs.append({"bytes": nb, "impl": impl, "time_us": t, "placement": peers.OUT, "busbw_GBps": 1.0})
    s = report.summary("allreduce", recs)
    assert "best a 8 B..8 B, b 1 KiB..1 KiB" in s and "a->b at 1 KiB" in s
    assert "auto within 10% of the best at 0/2 sizes" in s and "plait/mpi 0.5x..1.5x" in s
    assert report.comparison("allreduce", recs)[-1].split()[-1] == "1.5"
    # a 3% lead is noise: the previous winner keeps the size, so there is no crossover
    recs = [
        {"bytes": nb, "impl": i, "time_us": t}
        for nb, i, t in (
            (8, "plait:a", 1.0),
            (8, "plait:b", 2.0),
            (64, "plait:a", 1.03),
            (64, "plait:b", 1.0),
        )
    ]
    assert "best a 8 B..64 B; crossovers none" in report.summary("allreduce", recs)


def test_main_fails_loudly_on_a_wrong_result(monkeypatch, capsys):
    """In-process, one rank: a broken plait call must give #wrong > 0 and exit status 1."""
    server = _store.StoreServer("127.0.0.1", 0)
    for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("PLAIT_STORE", f"127.0.0.1:{server.port}")
    real = peers.Plait.prepare

    def broken(self, coll, x, out, dtype, op, root):
        run = real(self, coll, x, out, dtype, op, root)
        return (lambda: (run(), out.__setitem__(0, 0))) if coll.name == "allgather" else run

    monkeypatch.setattr(peers.Plait, "prepare", broken)
    try:
        rc = cli.main(["-c", "allreduce,allgather", "-b", "64", "-e", "64", "--time", "0.005", "--no-pin"])
    finally:
        server.close()
    out, err = capsys.readouterr()
    assert rc == 1
    assert "WRONG RESULT: allgather plait" in err and "FAILED" in out
    assert "allreduce" in out and out.count("<-- WRONG") == 1


def _bench(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "plait.bench", *map(str, args)],
        env=_ENV,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def test_cli_smoke_two_ranks(tmp_path):
    js = tmp_path / "bench.json"
    r = _bench(
        "-n",
        2,
        "-c",
        "allreduce,reduce_scatter,allgather,broadcast,reduce,alltoall",
        "-b",
        8,
        "-e",
        "64K",
        "-f",
        64,
        "-a",
        "all",
        "--time",
        0.01,
        "--trials",
        3,
        "--json",
        js,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    cols = next(ln for ln in lines if "#wrong" in ln).lstrip("#").split()
    cell = ["time", "algbw", "busbw", "#wrong"]
    assert cols == ["size", "count", "type", "redop", "root", "impl"] + cell * 2  # out-of-place, in-place
    rows = [ln.split() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert len(rows) >= 2 * 6
    for row in rows:
        assert len(row) == 14 and row[9] == row[13] == "0", row  # #wrong, both placements
    assert "# #wrong total: 0 OK" in lines
    assert sum(ln.startswith("# summary ") for ln in lines) == 6
    doc = json.loads(js.read_text())
    assert set(report.JSON_KEYS) <= set(doc) and doc["schema"] == report.SCHEMA
    assert {"cpu", "cores", "kernel", "build_info", "python", "numpy", "plait"} <= set(doc["machine"])
    assert doc["config"]["nranks"] == 2 and doc["config"]["sizes"] == [8, 512, 32768]
    assert {r["collective"] for r in doc["results"]} == set(COLLECTIVES)
    for coll in COLLECTIVES:  # -a all: a row per algorithm of every collective, not only allreduce's
        assert {r["impl"] for r in doc["results"] if r["collective"] == coll} == {"plait"} | {
            f"plait:{a}" for a in plait.algorithms(coll)
        }, coll
    for rec in doc["results"]:
        assert set(rec) == set(report.RECORD_KEYS) and rec["wrong"] == 0 and rec["time_us"] > 0
        assert isinstance(rec["trials_us"], list) and rec["nranks"] == 2


def test_every_variant_runs_the_algorithm_it_is_named_after():
    # A row labelled plait:<algo> must call that algorithm for every collective (it once ran
    # `auto` for broadcast, reduce and alltoall under a single_copy label).
    class Recorder:
        engine = ""

        def __getattr__(self, name):
            return lambda *a, **kw: calls.append((name, kw.get("algorithm", "auto")))

    x = np.zeros(4, np.float32)
    for coll in COLLECTIVES.values():
        for algo in plait.algorithms(coll.name):
            calls = []
            peers.Plait(Recorder(), algo).prepare(coll, x, x.copy(), "float32", "sum", 0)()
            assert calls == [(coll.name, algo)], (coll.name, algo, calls)
        calls = []
        peers.Plait(Recorder()).prepare(coll, x, x.copy(), "float32", "sum", 0)()
        assert calls == [(coll.name, "auto")]


def test_cli_shared_buffers_variant(tmp_path):
    # --shared adds plait over plait.empty buffers, checked and timed like every other variant.
    js = tmp_path / "bench.json"
    r = _bench(
        "-n",
        2,
        "-c",
        "allreduce,reduce_scatter,allgather",
        "-b",
        "64K",
        "-e",
        "1M",
        "-f",
        16,
        "--shared",
        "--time",
        0.01,
        "--trials",
        3,
        "--json",
        js,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# #wrong total: 0 OK" in r.stdout
    doc = json.loads(js.read_text())
    for coll in ("allreduce", "reduce_scatter", "allgather"):
        recs = [x for x in doc["results"] if x["collective"] == coll]
        assert {x["impl"] for x in recs} == {"plait", peers.SHARED}, coll
        assert {(x["bytes"], x["placement"]) for x in recs if x["impl"] == peers.SHARED} == {
            (nb, p) for nb in (65536, 1048576) for p in (peers.OUT, peers.IN)
        }
        assert all(x["wrong"] == 0 for x in recs)


def test_comparison_has_shared_ratios():
    recs = [
        {"bytes": 8, "impl": i, "time_us": t, "placement": peers.OUT, "busbw_GBps": 1.0}
        for i, t in (("plait", 2.0), (peers.SHARED, 1.0), ("mpi", 4.0))
    ]
    head, row = report.comparison("allreduce", recs)[1:]
    assert head.split()[-2:] == ["plait/mpi", "shared/mpi"] and row.split()[-2:] == ["0.5", "0.25"]
    assert "plait/mpi 0.5x..0.5x" in report.summary("allreduce", recs)
    assert "shared/mpi 0.25x..0.25x" in report.summary("allreduce", recs)


def _have(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.slow
def test_cli_peers_run_or_are_skipped():
    want = ["gloo", "mpi"] if _have("mpi4py") else ["gloo"]  # no mpi4py: a usage error (below)
    r = _bench(
        "-n", 2, "-c", "allreduce", "-b", 8, "-e", 8, "--time", 0.01, "--trials", 3, "--peers", ",".join(want)
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for p in want:
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(f"# peer {p}: "))
        assert "skipped: " in line or any(ln.split()[5:6] == [p] for ln in r.stdout.splitlines()), line


@pytest.mark.skipif(_have("mpi4py"), reason="mpi4py is installed: the mpi peer runs")
def test_cli_mpi_peer_without_mpi4py_is_a_usage_error_naming_the_install():
    r = _bench("-n", 2, "-c", "allreduce", "-b", 8, "-e", 8, "--peers", "mpi")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs mpi4py" in r.stderr and "pip install mpi4py" in r.stderr, r.stderr


def test_cli_usage_errors():
    assert _bench("-b", "1X").returncode == 2
    assert _bench("-c", "allscatter").returncode == 2
    assert _bench("-b", 64, "-e", 8).returncode == 2


def test_deepspeed_peer_supports_only_what_its_kernel_does():
    from plait.bench import collectives as C
    from plait.bench.peers import DeepSpeed

    ds = DeepSpeed(None, None, "0", "tag", False)
    ar = C.COLLECTIVES["allreduce"]
    assert ds.supports(ar, "float32", "sum", True) is None
    assert ds.supports(ar, "bfloat16", "sum", True) is None
    assert "in-place" in ds.supports(ar, "float32", "sum", False)
    assert "sum" in ds.supports(ar, "float32", "max", True)
    assert "sum" in ds.supports(ar, "int32", "sum", True)
    assert "allreduce only" in ds.supports(C.COLLECTIVES["allgather"], "float32", "sum", True)


def test_deepspeed_peer_missing_is_a_skip_with_the_reason(monkeypatch):
    import sys

    from plait.bench.peers import Skip, start_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(Skip, match="pip install deepspeed"):
        start_deepspeed(0, 2, None)
