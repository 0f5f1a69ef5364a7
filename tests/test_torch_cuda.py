"""CUDA tensors through the native torch backend, on machines without a GPU.

The native module's recording CUDA device (csrc/torch/testing.cc) makes torch believe in CUDA:
a CUDA device guard whose streams are numbers and whose events are log entries, and tensors
labelled cuda:0 over CPU memory. dist.* calls on them take torch's real path (c10d's CUDA
registrations) into the backend's CUDA code (csrc/torch/gpu.cc), which hands plait device buffers
through the C API. The group's communicator carries plait's recording GPU queue
(_C._FakeGpuQueue), attached as the first CUDA tensor would attach the real one: the core's GPU
call path (validate -> select -> check across ranks -> enqueue) runs for real and records what it
would have enqueued. The queue's records and the fake device's log are numbered by one counter,
so the tests assert exactly what reached the core (addresses, counts, dtype, op, root, peer,
stream) and in which order the call was enqueued, its event recorded, waited on and queried.

plait's calls move no data here; torch ops on the fake tensors (the backend's temporaries, copies
back, integer AVG's division) run on the host through the fake device's fallback kernel, so
values a step writes are exact too. Real kernels and NCCL are the GPU machine's suite's.
"""

from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import plait  # noqa: E402
import plait.torch  # noqa: E402 - registers the backend (and compiles it)
from plait import _C, _cuda  # noqa: E402
from plait.torch import _native  # noqa: E402
from test_torch_backend import init_pg, run_torch  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not plait.torch.native(), reason="the native backend serves these groups"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device: tests/gpu/ runs these"),
    pytest.mark.skipif(
        torch.backends.cuda.is_built(),
        reason="a CUDA build of torch owns the CUDA device type, so the recording one cannot be "
        "installed (these run under a CPU build of torch; tests/gpu/ runs the GPU side on a GPU)",
    ),
    pytest.mark.skipif(not _cuda.compiled(), reason="the GPU algorithm rows are compiled into CUDA builds"),
]

RUN_TIMEOUT = 90
STREAM = 3  # the current stream of cuda:0 while the calls are made


def _group(rank, n, store_dir, queue=True):
    """A "plait" group whose ranks have the recording CUDA device and (queue=True) the recording
    GPU queue on their communicator. Returns (module, queue or None)."""
    init_pg("plait", rank, n, store_dir)
    mod = _native._module
    mod._fake_cuda_install(_C._fake_gpu_clock)
    mod._fake_cuda_set_stream(0, STREAM)
    torch.cuda.get_device_capability = lambda device=None: (9, 0)  # dist.broadcast asks (fp8)
    comm = plait.torch.communicator()
    q = None
    if queue:
        _cuda.compiled = lambda: True
        _cuda.device_count = lambda: 1
        # across hosts the queue spans every host; its CPU side is this host's communicator
        cpu = getattr(comm, "local", comm)._c
        q = _C._FakeGpuQueue(cpu, 0, "nccl", 30.0, "", rank=comm.rank, size=comm.size)
        _C.gpu_attach(comm._c, q)
        comm._gpu = q
    return mod, q


def _cuda_like(mod, t, device=0):
    return mod._fake_cuda_tensor(t, device)


def _events(mod, since=0):
    """The fake device's log after seq `since`, without stream queries of torch's own."""
    return [e for e in mod._fake_cuda_log() if e[3] > since]


# -- one all_reduce, sync and async: buffers, stream, and the order of what happens ------------
def _all_reduce_order(rank, n, store_dir):
    mod, q = _group(rank, n, store_dir)
    h = mod._fake_cuda_stream_handle(STREAM)
    x = torch.arange(8, dtype=torch.float32) * (rank + 1)
    t = _cuda_like(mod, x)
    assert t.is_cuda and t.device == torch.device("cuda", 0) and t.data_ptr() == x.data_ptr()
    out = {}

    dist.all_reduce(t)  # sync: enqueued, event recorded, the current stream waits on it
    (call,) = q.log()
    out["sync_call"] = call
    out["sync_events"] = _events(mod)

    start = mod._fake_cuda_log()[-1][3]
    w = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    call2 = q.log()[1]
    out["async_call"] = call2
    out["before_finish"] = w.is_completed()
    try:  # a timeout makes the host wait for the GPU, as NCCL's Work does; it is not there yet
        w.wait(timedelta(milliseconds=100))
        out["timed_out"] = (None, "no error")
    except dist.DistBackendError as e:
        out["timed_out"] = (type(e).__name__, str(e))
    mod._fake_cuda_finish(-1)  # the fake GPU got past every event recorded so far
    w.wait(timedelta(seconds=5))  # it is now: at once
    out["after_finish"] = w.is_completed()
    mod._fake_cuda_set_stream(0, 5)  # the waiter is on another stream now
    w.wait()
    out["async_events"] = _events(mod, start)
    mark = mod._fake_cuda_log()[-1][3]
    fut = w.get_future()
    fut.wait()
    out["future_events"] = _events(mod, mark)
    out["future_value"] = [v.data_ptr() for v in fut.value()]
    out["then"] = fut.then(lambda f: f.value()[0].data_ptr() + 1).wait()  # DDP's comm hooks chain
    out["handle"] = h
    out["ptr"] = x.data_ptr()
    comm = plait.torch.communicator()
    dist.destroy_process_group()  # finalizes the GPU queue, then the communicator
    out["queue_after"] = comm._gpu
    return out


def test_all_reduce_is_enqueued_on_the_current_stream_and_completes_in_stream_order(tmp_path):
    for rank, o in enumerate(run_torch(_all_reduce_order, 2, tmp_path, timeout=RUN_TIMEOUT)):
        ptr, h = o["ptr"], o["handle"]
        call = o["sync_call"]
        assert {k: v for k, v in call.items() if k not in ("seq", "algo")} == {
            "coll": "allreduce",
            "count": 8,
            "stream": h,
            "in": ptr,
            "out": ptr,
            "dtype": "float32",
            "op": "sum",
            "root": 0,
            "peer": -1,
        }, (rank, call)
        # The tensor is recorded on the call's stream before the call; the event is recorded on it
        # after the call was enqueued; the (sync) caller's current stream waits on that event.
        ev = o["sync_events"]
        kinds = [(e[0], e[2]) for e in ev]
        assert ("record_stream", STREAM) in kinds and kinds[-2:] == [("record", STREAM), ("block", STREAM)], (
            ev
        )
        stream_recs = [e for e in ev if e[0] == "record_stream"]
        assert {e[1] for e in stream_recs} == {ptr} and all(e[3] < call["seq"] for e in stream_recs), ev
        record, block = ev[-2], ev[-1]
        assert call["seq"] < record[3] < block[3] and record[1] == block[1], ev

        a = o["async_call"]
        assert (a["coll"], a["op"], a["count"], a["stream"], a["in"]) == ("allreduce", "max", 8, h, ptr)
        assert o["before_finish"] is False and o["after_finish"] is True
        kind, text = o["timed_out"]
        assert kind == "PlaitTimeoutError" and "Work.wait Timed out after 100 ms" in text, o["timed_out"]
        aev = o["async_events"]
        recs = [e for e in aev if e[0] == "record"]
        assert len(recs) == 1 and recs[0][2] == STREAM and recs[0][3] > a["seq"], aev
        queries = [e[2] for e in aev if e[0] == "query" and e[1] == recs[0][1]]
        # not reached (is_completed, then the timed wait's polls), then reached
        assert len(queries) >= 3 and set(queries[:-2]) == {0} and queries[-2:] == [1, 1], aev
        assert aev[-1][:3] == ("block", recs[0][1], 5), aev  # wait(): the waiter's stream waits

        # The Future is CUDA-aware: its event goes on the call's stream, its waiter's stream waits.
        fev = o["future_events"]
        frec = [e for e in fev if e[0] == "record"]
        assert frec and frec[0][2] == STREAM, fev
        assert ("block", frec[0][1], 5) in [e[:3] for e in fev], fev
        assert o["future_value"] == [ptr] and o["then"] == ptr + 1
        assert o["queue_after"] is None


# -- every collective: what the core receives ---------------------------------------------------
def _collectives(rank, n, store_dir):
    mod, q = _group(rank, n, store_dir)
    f = torch.arange(8, dtype=torch.float32) + 10 * rank
    out16 = torch.zeros(16, dtype=torch.float32)
    out4 = torch.zeros(4, dtype=torch.float32)
    out8 = torch.zeros(8, dtype=torch.float32)
    i64 = torch.arange(6, dtype=torch.int64)
    t, t16, t4, t8, ti = (_cuda_like(mod, x) for x in (f, out16, out4, out8, i64))
    dist.broadcast(t, src=1)
    dist.reduce(t, dst=0, op=dist.ReduceOp.MIN)
    dist.all_gather_into_tensor(t16, t)
    dist.reduce_scatter_tensor(t4, t, op=dist.ReduceOp.AVG)
    dist.all_to_all_single(t8, t)
    dist.all_reduce(ti, op=dist.ReduceOp.PRODUCT)
    if rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t8, src=0)
    ptrs = {k: v.data_ptr() for k, v in (("f", f), ("o16", out16), ("o4", out4), ("o8", out8), ("i", i64))}
    return [{k: v for k, v in r.items() if k not in ("seq", "algo")} for r in q.log()], ptrs


def _rec(coll, count, i, o, dtype, op="sum", root=0, peer=-1):
    """A recording-queue entry as the core receives it on stream STREAM of the fake device."""
    stream = 0x5EA0000 + STREAM  # the fake device's handle of that stream (testing.cc)
    return dict(
        coll=coll, count=count, stream=stream, dtype=dtype, op=op, root=root, peer=peer, **{"in": i, "out": o}
    )


def test_every_collective_reaches_the_core_as_device_buffers(tmp_path):
    rec = _rec
    for rank, (log, p) in enumerate(run_torch(_collectives, 2, tmp_path, timeout=RUN_TIMEOUT)):
        f = p["f"]
        want = [
            rec("broadcast", 32, f, f, "uint8", root=1),  # data movement: raw bytes
            rec("reduce", 8, f, f if rank == 0 else 0, "float32", op="min"),  # no output off the root
            rec("allgather", 32, f, p["o16"], "uint8"),
            rec("reduce_scatter", 4, f, p["o4"], "float32", op="avg"),
            rec("alltoall", 16, f, p["o8"], "uint8"),  # bytes per peer
            rec("allreduce", 6, p["i"], p["i"], "int64", op="prod"),
            rec("send", 32, f, 0, "uint8", peer=1)
            if rank == 0
            else rec("recv", 32, 0, p["o8"], "uint8", peer=0),
        ]
        assert log == want, (rank, log)


# -- bad input: raised on every rank, or refused before anything is enqueued ---------------------
def _bad(rank, n, store_dir, case):
    mod, q = _group(rank, n, store_dir, queue=case != "no_device")
    x = torch.arange(8, dtype=torch.float32)
    t = _cuda_like(mod, x)
    try:
        if case == "no_device":  # a CUDA build on a machine without a device: the queue cannot be made
            _cuda.compiled = lambda: True
            dist.all_reduce(t)
        elif case == "mixed_devices":
            out = torch.zeros(16) if rank == 0 else _cuda_like(mod, torch.zeros(16))
            dist.all_gather_into_tensor(out, t)
        elif case == "other_gpu":
            dist.all_reduce(_cuda_like(mod, x, device=1) if rank == 0 else t)
        elif case == "mixed_list" and rank == 0:  # rank 1 learns of it at its barrier
            dist.all_gather([_cuda_like(mod, torch.zeros(8)), torch.zeros(8)], t)
        elif case == "later_gpu":  # the queue is on GPU 0 after the first call
            dist.all_reduce(t)
            dist.all_reduce(_cuda_like(mod, x, device=1) if rank == 1 else t)
        elif case == "tag":
            dist.send(t, dst=1, tag=3) if rank == 0 else dist.recv(t, src=0, tag=3)
        dist.barrier()  # a rank whose own call was sound learns of the abort here
    except dist.DistBackendError as e:
        return type(e).__name__, str(e), len(q.log()) if q is not None else 0
    return None, "no error", len(q.log()) if q is not None else 0


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("no_device", "no CUDA device is visible"),
        ("mixed_devices", "input on cuda:0, output on cpu; pass both on one device"),
        ("other_gpu", "runs on GPU 0; every GPU array of a rank must be on one GPU"),
        ("mixed_list", "allgather: tensors on cuda:0 and cpu in one call; pass all of them on one device"),
        ("later_gpu", "a CUDA tensor on GPU 1, but this group's GPU work runs on GPU 0"),
        ("tag", "GPU send/recv have no tags"),
    ],
)
def test_bad_cuda_calls_raise_on_every_rank(tmp_path, case, pattern):
    for rank, (kind, msg, _) in enumerate(run_torch(_bad, 2, tmp_path, timeout=RUN_TIMEOUT, args=(case,))):
        assert kind is not None, (rank, msg)
        assert isinstance(msg, str) and pattern in msg, (rank, kind, msg)
        assert kind == "PlaitInvalidArgument", (rank, kind, msg)
        # the group and rank that raised, then the rank whose input was refused
        assert f"(rank {rank} of 2)" in msg or "plait on group" in msg, (rank, msg)


def _unsupported(rank, n, store_dir):
    mod, q = _group(rank, n, store_dir)
    t = _cuda_like(mod, torch.arange(4, dtype=torch.float32))
    seen = None
    if rank == 0:
        try:
            dist.recv(t)  # any source: NCCL has no such receive
        except dist.DistBackendError as e:
            seen = (type(e).__name__, str(e))
    dist.all_reduce(t)  # the group is still usable on every rank
    return seen, [r["coll"] for r in q.log()]


def test_any_source_recv_of_a_cuda_tensor_is_refused_on_its_rank_only(tmp_path):
    (seen, log0), (none, log1) = run_torch(_unsupported, 2, tmp_path, timeout=RUN_TIMEOUT)
    assert seen[0] == "PlaitUnsupportedError" and "no any-source receive" in seen[1], seen
    assert "recv from any source" in seen[1] and "rank 0" in seen[1], seen
    assert none is None and log0 == log1 == ["allreduce"]


def test_registered_for_cpu_and_cuda():
    assert set(dist.Backend.backend_capability["plait"]) == {"cpu", "cuda"}


def _coalesced(rank, n, store_dir):
    mod, q = _group(rank, n, store_dir)
    a, b = torch.arange(4, dtype=torch.float32), torch.arange(6, dtype=torch.int32)
    ta, tb = _cuda_like(mod, a), _cuda_like(mod, b)
    with dist._coalescing_manager(device=torch.device("cuda", 0), async_ops=True) as cm:
        dist.all_reduce(ta, op=dist.ReduceOp.MAX)  # torch coalesces calls of one op
        dist.all_reduce(tb, op=dist.ReduceOp.MAX)
    mark = mod._fake_cuda_log()[-1][3]
    cm.wait()
    log = [(r["coll"], r["count"], r["dtype"], r["op"], r["in"]) for r in q.log()]
    return log, (a.data_ptr(), b.data_ptr()), _events(mod, mark)


def test_coalesced_cuda_calls_are_each_enqueued_and_waited_on_the_stream(tmp_path):
    for log, (pa, pb), waited in run_torch(_coalesced, 2, tmp_path, timeout=RUN_TIMEOUT):
        # not fused on a GPU (that would need a copy kernel): one call each, in order
        assert log == [("allreduce", 4, "float32", "max", pa), ("allreduce", 6, "int32", "max", pb)], log
        assert waited and all(e[0] == "block" and e[2] == STREAM for e in waited), waited


def _first_send(rank, n, store_dir):
    mod, _ = _group(rank, n, store_dir, queue=False)
    _cuda.compiled = lambda: True
    _cuda.device_count = lambda: 1
    t = _cuda_like(mod, torch.arange(4, dtype=torch.float32))
    if rank == 2:
        return None
    try:
        dist.send(t, dst=1) if rank == 0 else dist.recv(t, src=0)
    except dist.DistBackendError as e:
        return type(e).__name__, str(e)
    return None


def test_first_cuda_call_of_a_larger_group_must_be_a_collective(tmp_path):
    got = run_torch(_first_send, 3, tmp_path, timeout=RUN_TIMEOUT)
    for rank, r in enumerate(got[:2]):
        assert r is not None and r[0] == "PlaitInvalidArgument", (rank, r)
        assert "the first CUDA call of a group of 3 ranks must be a collective" in r[1], (rank, r)
    assert got[2] is None


# -- calls with steps around them (torch ops on the fake tensors run on the host) ---------------
def _uneven_all_to_all(rank, n, store_dir):
    mod, q = _group(rank, n, store_dir)
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2) + 100 * rank  # 1, 2, 3 rows to ranks 0, 1, 2
    out = torch.full((3 * (rank + 1), 2), -1.0)  # rank + 1 rows from each
    dist.all_to_all_single(
        _cuda_like(mod, out),
        _cuda_like(mod, x),
        output_split_sizes=[rank + 1] * 3,
        input_split_sizes=[1, 2, 3],
    )
    log = [(r["coll"], r["peer"], r["count"], r["in"], r["out"]) for r in q.log()]
    return log, x.data_ptr(), out.data_ptr(), out.tolist()


def test_uneven_all_to_all_pairs_gpu_sends_and_receives_in_an_order_that_cannot_deadlock(tmp_path):
    for me, (log, xp, op, out) in enumerate(run_torch(_uneven_all_to_all, 3, tmp_path, timeout=RUN_TIMEOUT)):
        want = []
        for j in range(3):
            if j == me:
                continue
            send = ("send", j, 8 * (j + 1), xp + 8 * sum(range(1, j + 1)), 0)  # rows 0, 1-2, 3-5
            recv = ("recv", j, 8 * (me + 1), 0, op + 8 * (me + 1) * j)
            # of each pair the lower rank sends first, the higher receives first
            want += [recv, send] if j < me else [send, recv]
        assert log == want, (me, log)
        # its own rows are copied on the stream after the calls; the peers' rows plait would write
        first = sum(range(1, me + 1))
        mine = [[100.0 * me + 2 * (first + k), 100.0 * me + 2 * (first + k) + 1] for k in range(me + 1)]
        assert out[me * (me + 1) : (me + 1) * (me + 1)] == mine, (me, out)


def _int_avg(rank, n, store_dir):
    mod, q = _group(rank, n, store_dir)
    x = torch.arange(6, dtype=torch.int32) * 2 + 1
    dist.all_reduce(_cuda_like(mod, x), op=dist.ReduceOp.AVG)
    return [(r["coll"], r["op"], r["dtype"], r["count"]) for r in q.log()], x.tolist()


def test_integer_avg_sums_then_divides_on_the_stream(tmp_path):
    for log, x in run_torch(_int_avg, 2, tmp_path, timeout=RUN_TIMEOUT):
        assert log == [("allreduce", "sum", "int32", 6)], log
        # plait moved nothing here, so the step divided this rank's own values, truncating
        assert x == [(2 * i + 1) // 2 for i in range(6)], x


def _gather_scatter(rank, n, store_dir):
    mod, q = _group(rank, n, store_dir)
    x = torch.arange(4, dtype=torch.float32) + 10 * (rank + 1)
    outs = [torch.full((4,), -1.0) for _ in range(n)]
    ins = [torch.arange(4, dtype=torch.float32) + 100 * (j + 1) for j in range(n)]
    got = torch.full((4,), -1.0)
    tx = _cuda_like(mod, x)
    dist.gather(tx, [_cuda_like(mod, o) for o in outs] if rank == 0 else None, dst=0)
    dist.scatter(_cuda_like(mod, got), [_cuda_like(mod, i) for i in ins] if rank == 0 else None, src=0)
    log = [(r["coll"], r["peer"], r["count"], r["in"], r["out"]) for r in q.log()]
    ptrs = dict(
        x=x.data_ptr(), outs=[o.data_ptr() for o in outs], ins=[i.data_ptr() for i in ins], got=got.data_ptr()
    )
    return log, ptrs, outs[0].tolist(), got.tolist()


def test_gather_and_scatter_run_as_gpu_sends_and_receives_without_tags(tmp_path):
    (log0, p0, own0, got0), (log1, p1, _, _) = run_torch(_gather_scatter, 2, tmp_path, timeout=RUN_TIMEOUT)
    # plait's internal tag is dropped (GPU send/recv have none; a tag would be refused)
    assert log0 == [("recv", 1, 16, 0, p0["outs"][1]), ("send", 1, 16, p0["ins"][1], 0)], log0
    assert log1 == [("send", 0, 16, p1["x"], 0), ("recv", 0, 16, 0, p1["got"])], log1
    # the root's own block is copied by a step after the calls
    assert own0 == [10.0, 11.0, 12.0, 13.0] and got0 == [100.0, 101.0, 102.0, 103.0]


def _reduce_int_avg(rank, n, store_dir):
    mod, q = _group(rank, n, store_dir)
    x = torch.arange(6, dtype=torch.int64) * 2 + 1
    dist.reduce(_cuda_like(mod, x), dst=0, op=dist.ReduceOp.AVG)
    return [(r["coll"], r["op"], r["root"], r["in"], r["out"]) for r in q.log()], x.data_ptr(), x.tolist()


def test_reduce_leaves_a_non_root_tensor_alone(tmp_path):
    for rank, (log, ptr, x) in enumerate(run_torch(_reduce_int_avg, 2, tmp_path, timeout=RUN_TIMEOUT)):
        assert log == [("reduce", "sum", 0, ptr, ptr if rank == 0 else 0)], log
        # the root divides what plait left (here its own values); a non-root has no output to divide
        assert x == ([(2 * i + 1) // 2 for i in range(6)] if rank == 0 else [2 * i + 1 for i in range(6)]), x


# -- a group across hosts: CUDA tensors reach the one GPU queue of all ranks ---------------------
def _across_hosts(rank, n, store_dir):
    import os

    os.environ["PLAIT_HOST_ID"] = f"host{rank}"  # one rank per simulated host
    mod, q = _group(rank, n, store_dir)
    comm = plait.torch.communicator()
    out = {"hier": isinstance(comm._c, _C.HierComm)}
    t = _cuda_like(mod, torch.arange(6, dtype=torch.int32) + rank)
    dist.all_reduce(t)
    w = dist.broadcast(t, src=1, async_op=True)
    mod._fake_cuda_finish(-1)
    w.wait()
    out["log"] = [
        {k: c[k] for k in ("coll", "count", "dtype", "op", "root", "stream", "in")} for c in q.log()
    ]
    out["ptr"] = t.data_ptr()
    out["handle"] = mod._fake_cuda_stream_handle(STREAM)
    try:
        _C.gpu_attach(comm._c, q)
    except plait.InvalidArgument as e:
        out["twice"] = str(e)
    dist.destroy_process_group()
    return out


def test_cuda_tensors_on_a_group_across_hosts_take_the_queue_of_all_ranks(tmp_path):
    for rank, o in enumerate(run_torch(_across_hosts, 2, tmp_path, timeout=RUN_TIMEOUT)):
        assert o["hier"], rank
        ptr, h = o["ptr"], o["handle"]
        assert o["log"] == [
            {
                "coll": "allreduce",
                "count": 6,
                "dtype": "int32",
                "op": "sum",
                "root": 0,
                "stream": h,
                "in": ptr,
            },
            {
                "coll": "broadcast",  # as bytes, as on one host
                "count": 24,
                "dtype": "uint8",
                "op": "sum",
                "root": 1,
                "stream": h,
                "in": ptr,
            },
        ], (rank, o["log"])
        assert "already has a GPU transport" in o["twice"], o
