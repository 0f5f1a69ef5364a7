"""The one algorithm table and the ordered transport table (csrc/algo/table.cc,
csrc/transport/table.cc), checked through the module: every collective's rows, capability
filtering, auto's choices (the measured thresholds, restated here from the table as it was
before the tables merged), and GPU rows and transports present only in a CUDA build."""

import os

import numpy as np
import pytest

import plait
from plait import _C, _comm, _cuda
from conftest import run_ranks

COLLS = [
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "alltoall",
    "barrier",
    "send",
    "recv",
]
HOST = {
    "allreduce": ["one_shot", "two_shot", "ring", "tree", "single_copy", "shared_or_staged", "staged_parts"],
    "reduce_scatter": ["direct", "ring", "single_copy"],
    "allgather": ["direct", "ring", "single_copy", "shared_or_staged"],
    "broadcast": ["direct", "single_copy"],
    "reduce": ["direct", "single_copy"],
    "alltoall": ["direct", "single_copy"],
    "barrier": ["direct"],
    "send": [],
    "recv": [],
}
NCCL = {
    "allreduce": ["nccl", "ring", "tree"],
    "reduce_scatter": ["nccl", "ring"],
    "allgather": ["nccl", "ring"],
    "broadcast": ["nccl"],
    "reduce": ["nccl"],
    "alltoall": ["nccl"],
    "send": ["nccl"],
    "recv": ["nccl"],
    "barrier": [],
}
IPC = {
    "allreduce": ["one_shot", "two_shot", "ring"],
    "reduce_scatter": ["one_shot", "ring"],
    "allgather": ["one_shot", "ring"],
}
RUNS_ON = {"shm": "host", "nccl": "gpu", "ipc": "ipc"}


def _caps():
    return {name: set(caps) for name, caps, _ in _C.transports()}


def test_every_collectives_rows():
    rows = _C.algorithm_rows()
    gpu = _cuda.compiled()
    for coll in COLLS:
        mine = [(name, kind) for c, name, _, kind in rows if c == coll]
        want = [(a, "host") for a in HOST[coll]]
        if gpu:
            want += [(a, "gpu") for a in NCCL[coll]] + [(a, "ipc") for a in IPC.get(coll, [])]
        assert sorted(mine) == sorted(want), coll
        assert plait.algorithms(coll) == HOST[coll] == _C.algorithms(coll, "shm")
        assert _C.algorithms(coll, "nccl") == (NCCL[coll] if gpu else [])
        assert _C.algorithms(coll, "ipc") == (IPC.get(coll, []) if gpu else [])


def test_rows_need_what_their_runner_uses():
    caps = _caps()
    for coll, name, needs, kind in _C.algorithm_rows():
        assert needs, (coll, name)
        # A row is offered to exactly one transport, the one whose communicator runs its kind.
        takers = [t for t, offered in caps.items() if set(needs) <= offered]
        assert [RUNS_ON[t] for t in takers] == [kind], (coll, name, needs, takers)


def test_offered_rows_are_those_the_caps_cover():
    rows = _C.algorithm_rows()
    for t, offered in _caps().items():
        for coll in COLLS:
            want = [n for c, n, needs, _ in rows if c == coll and set(needs) <= offered]
            assert _C.algorithms(coll, t) == want, (t, coll)
            assert len(set(want)) == len(want), (t, coll, "a name twice for one transport")


def test_without_peer_read_no_single_copy():
    for coll in COLLS:
        staged = _C.algorithms_with(coll, ["host_staging"])
        assert staged == [a for a in HOST[coll] if a not in ("single_copy", "shared_or_staged")], coll
        assert _C.algorithms_with(coll, ["peer_read"]) == []  # single copy stages too
        assert _C.algorithms_with(coll, ["host_staging", "peer_read"]) == HOST[coll]
    with pytest.raises(plait.InvalidArgument, match="unknown capability 'teleport'"):
        _C.algorithms_with("allreduce", ["teleport"])


def test_gpu_rows_are_never_offered_to_shm():
    shm = _caps()["shm"]
    gpu_rows = [(c, n, needs) for c, n, needs, kind in _C.algorithm_rows() if kind != "host"]
    assert bool(gpu_rows) == _cuda.compiled()
    for c, n, needs in gpu_rows:
        assert not set(needs) <= shm, (c, n, needs)
        assert not set(needs) & shm, (c, n, needs)  # they need a GPU transport's caps only
    # one_shot over shm is the host row, never the IPC one (same name, other needs).
    for c, n, needs, kind in _C.algorithm_rows():
        if n in _C.algorithms(c, "shm"):
            assert kind == "host" or not set(needs) <= shm


def _old_auto(coll, nbytes, world, staging, single_copy, oversubscribed):
    """auto_select as table.cc's comment gives it (index into the host table), written out again."""
    sc = single_copy and not oversubscribed
    k, m = 1024, 1 << 20
    # the 2-rank crossovers measured on the AMD VM (RESULTS.md 2026-12-04)
    two = sc and world == 2
    if coll == "reduce_scatter":
        i = 2 if sc and nbytes >= 16 * k else 0
    elif coll == "allgather" and two and nbytes >= 8 * k:
        i = 2 if 32 * k <= nbytes < 256 * k or nbytes >= 4 * m else 3
    elif coll == "allgather":
        i = 2 if sc and nbytes >= 8 * k else 0
    elif coll == "broadcast":
        i = 1 if sc and nbytes >= 16 * k else 0
    elif coll == "reduce":
        i = 1 if sc and 16 * k <= nbytes < (64 << 20) else 0
    elif coll == "allreduce" and two and nbytes >= 2 * k:
        i = 2 if nbytes < 16 * k else 4 if 64 * k <= nbytes < 256 * k or nbytes >= 8 * m else 5
    elif coll == "allreduce":
        one_shot_max = 64 * k if world <= 2 else 16 * k
        if sc and nbytes >= 16 * k:
            i = 4
        elif nbytes <= one_shot_max and nbytes <= staging // 2:
            i = 0
        else:
            i = 2 if world <= 2 else 1
    else:
        i = 0
    return HOST[coll][i]


SIZES = [
    0,
    1,
    4,
    4095,
    8191,
    8192,
    16383,
    16384,
    32768,
    65536,
    65537,
    262143,
    262144,
    1 << 20,
    (4 << 20) - 1,
    4 << 20,
    8 << 20,
    16 << 20,
    (32 << 20) - 1,
    32 << 20,
    (64 << 20) - 1,
    64 << 20,
    1 << 30,
]


@pytest.mark.parametrize(
    "coll", ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall", "barrier"]
)
def test_auto_is_unchanged(coll):
    checked = 0
    for nbytes in SIZES:
        for world in (1, 2, 3, 4, 8, 64):
            for staging in (4096, 64 << 10, 2 << 20):
                for single_copy in (False, True):
                    for over in (False, True):
                        caps = ["host_staging"] + (["peer_read"] if single_copy else [])
                        got = _C.auto_algorithm(coll, nbytes, world, staging, caps, over)
                        assert got == _old_auto(coll, nbytes, world, staging, single_copy, over), (
                            coll,
                            nbytes,
                            world,
                            staging,
                            single_copy,
                            over,
                        )
                        assert got in _C.algorithms_with(coll, caps)
                        checked += 1
    assert checked == len(SIZES) * 6 * 3 * 2 * 2


def test_gpu_auto_is_each_transports_first_row():
    for coll in COLLS:
        assert _C.auto_algorithm(coll, 1 << 20, 4, 0, ["nccl_p2p", "nccl_collectives"]) == "nccl"
        assert _C.auto_algorithm(coll, 1 << 20, 4, 0, ["cuda_ipc"]) == "one_shot"
        for t in ("nccl", "ipc"):
            names = _C.algorithms(coll, t)
            if names:
                assert _C.auto_algorithm(coll, 64, 2, 0, sorted(_caps()[t])) == names[0], (coll, t)


def test_transport_table_is_ordered_and_probed():
    table = _C.transports()
    assert [t[0] for t in table] == ["shm", "ipc", "nccl"]
    assert [t[0] for t in table if t[2]] == plait.build_info()["transports"]
    assert [t[2] for t in table] == [True, _cuda.compiled(), _cuda.compiled()]
    assert _C.select_transport(device_buffers=False) == "shm"
    assert _C.select_transport(device_buffers=False, one_host=False) is None  # shm stays on a host
    with pytest.raises(plait.InvalidArgument, match=r"unknown transport 'tpu' \(shm, ipc, nccl\)"):
        _C.algorithms("allreduce", "tpu")


def _old_gpu_choice(one_host, shared, loaded, prefer):
    """What _gpu._communicator chose before the table: ipc, nccl, or None (it raised)."""
    if one_host and (prefer == "ipc" or (prefer == "auto" and shared)):
        return "ipc"
    return None if shared or not loaded else "nccl"


def test_gpu_transport_choice():
    for one_host in (True, False):
        for shared in (False, True):
            for loaded in (False, True):
                for prefer in ("auto", "nccl", "ipc"):
                    if prefer == "ipc" and not one_host:
                        continue  # refused before the table is asked (_gpu._transport)
                    got = _C.select_transport(
                        device_buffers=True,
                        one_host=one_host,
                        shared_gpu=shared,
                        nccl_loaded=loaded,
                        prefer=prefer,
                    )
                    want = _old_gpu_choice(one_host, shared, loaded, prefer) if _cuda.compiled() else None
                    assert got == want, (one_host, shared, loaded, prefer)


def test_cpu_build_has_no_gpu_rows_and_refuses_gpu_arrays():
    if _cuda.compiled():
        pytest.skip("a CUDA build: its GPU rows are checked above")
    for coll in COLLS:
        assert plait.algorithms(coll, device="cuda") == []
    assert all(kind == "host" for *_, kind in _C.algorithm_rows())


def _auto_picks(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=30)
    with comm:
        picks = []
        for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"):
            for nbytes in (64, 8 << 10, 16 << 10, 96 << 10, 1 << 20):
                x = np.ones(nbytes // 4 * (n if coll in ("reduce_scatter", "alltoall") else 1), np.int32)
                getattr(comm, coll)(*((x, 0) if coll in ("broadcast", "reduce") else (x,)))
                last = plait.dump(comm)["ranks"][rank]["calls"][-1]
                picks.append((coll, nbytes, last["algorithm"]))
        return comm.single_copy, picks


def test_a_communicator_runs_what_auto_picks():
    n = 2
    results = run_ranks(_auto_picks, n, timeout=120)
    staging = _comm.segment_params(n, None)[0] // 2
    over = n > _comm._cpus()
    for single_copy, picks in results:
        for coll, nbytes, algo in picks:
            assert algo == _old_auto(coll, nbytes, n, staging, single_copy, over), (coll, nbytes, algo)


def _forced(rank, n, store):
    comm = plait.init(rank, n, store=store, timeout=30)
    with comm:
        comm.allreduce(np.ones(16, np.int32))
        return plait.dump(comm)["ranks"][rank]["calls"][-1]["algorithm"]


def test_plait_algo_forces_by_name_through_the_table():
    assert run_ranks(_forced, 2, timeout=60, env={"PLAIT_ALGO": "allreduce=tree"}) == ["tree", "tree"]
    # A blanket name forces the collectives that have it; the others keep auto.
    assert run_ranks(_forced, 2, timeout=60, env={"PLAIT_ALGO": "two_shot"}) == ["two_shot"] * 2


def test_plait_algo_naming_a_gpu_row_is_refused():
    if "PLAIT_ALGO" in os.environ:
        pytest.skip("PLAIT_ALGO is set for the whole run")

    def fn(rank, n, store):
        try:
            plait.init(rank, n, store=store, timeout=30).finalize()
        except plait.InvalidArgument as e:
            return str(e)
        return None

    # One rank: each process parses its own PLAIT_ALGO when it joins, and a rank that fails
    # there leaves its peers without a segment to join (another error).
    for env in ({"PLAIT_ALGO": "nccl"}, {"PLAIT_ALGO": "allreduce=nccl"}):
        [msg] = run_ranks(fn, 1, timeout=60, env=env)
        assert msg and "PLAIT_ALGO" in msg and "names no algorithm" in msg, (env, msg)
