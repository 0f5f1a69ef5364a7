"""Exact checks of every collective on a communicator, for the simulated-host tests.

Run inside each rank (run_ranks, or a script under mpirun); raises AssertionError naming the
collective, dtype, op, count and mode on the first wrong element; returns the number of checks.
Data are small integers from a closed formula, so every result is exact in every dtype.
"""

import numpy as np

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"]
OPS = ["sum", "prod", "min", "max", "avg"]


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def data(rank, count, dtype, salt=0):
    k = np.arange(count)
    if dtype == "bool":
        return (rank + k + salt) % 2 == 0
    return (1 + (rank + k + salt) % 3).astype(np_dtype(dtype))  # 1..3: a product of 4 fits int8


def expected(size, count, dtype, op):
    stack = np.stack([data(r, count, dtype) for r in range(size)]) if count else np.zeros((size, 0))
    if dtype == "bool":
        return (stack.any(0) if op in ("sum", "max") else stack.all(0)).astype(bool)
    s = stack.astype(np.float64)
    v = {"sum": s.sum(0), "avg": s.sum(0), "prod": s.prod(0), "min": s.min(0), "max": s.max(0)}[op]
    if op == "avg":
        acc = np.float64 if dtype == "float64" else np.float32  # halves average in float32
        v = v.astype(acc) / acc(size)
    return v.astype(np_dtype(dtype))


def _same(got, want, what):
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
        bad = np.nonzero(got != want)[0][:5] if got.shape == want.shape else "shape"
        raise AssertionError(
            f"{what}: got {got[:8]} ({got.dtype}, {got.shape}), want {want[:8]} "
            f"({want.dtype}, {want.shape}); first bad {bad}"
        )


def ops_of(dtype):
    return [op for op in OPS if op != "avg" or dtype in ("float16", "bfloat16", "float32", "float64")]


def reductions(comm, count, dtypes=DTYPES, ops=None):
    """allreduce, reduce_scatter and reduce, out of place and in place."""
    rank, size, n = comm.rank, comm.size, 0
    for dt in dtypes:
        for op in ops or ops_of(dt):
            want = expected(size, count, dt, op)
            tag = f"rank {rank}: {dt} {op} count {count}"
            x = data(rank, count, dt)
            _same(comm.allreduce(x, op=op), want, f"allreduce {tag}")
            y = data(rank, count, dt)
            comm.allreduce(y, out=y, op=op)
            _same(y, want, f"allreduce in place {tag}")
            full = expected(size, count * size, dt, op)
            mine = full[rank * count : (rank + 1) * count]
            x = data(rank, count * size, dt)
            _same(comm.reduce_scatter(x, op=op), mine, f"reduce_scatter {tag}")
            comm.reduce_scatter(x, out=x[rank * count : (rank + 1) * count], op=op)
            _same(x[rank * count : (rank + 1) * count], mine, f"reduce_scatter in place {tag}")
            root = size - 1
            got = comm.reduce(data(rank, count, dt), root=root, op=op)
            if rank == root:
                _same(got, want, f"reduce {tag}")
            else:
                assert got is None, f"reduce {tag}: non-root got {got!r}"
            n += 4
    return n


def movements(comm, count, dtypes=DTYPES):
    """allgather, broadcast, alltoall, send/recv and barrier."""
    rank, size, n = comm.rank, comm.size, 0
    for dt in dtypes:
        tag = f"rank {rank}: {dt} count {count}"
        every = np.stack([data(r, count, dt, salt=r) for r in range(size)])
        _same(comm.allgather(data(rank, count, dt, salt=rank)), every, f"allgather {tag}")
        out = np.empty((size, count), dtype=np_dtype(dt))
        out[rank] = data(rank, count, dt, salt=rank)
        comm.allgather(out[rank], out=out)
        _same(out, every, f"allgather in place {tag}")
        for root in sorted({0, size - 1}):
            b = data(rank, count, dt, salt=rank)
            comm.broadcast(b, root=root)
            _same(b, data(root, count, dt, salt=root), f"broadcast root {root} {tag}")
            o = np.empty(count, dtype=np_dtype(dt))
            comm.broadcast(data(rank, count, dt, salt=rank), root=root, out=o)
            _same(o, data(root, count, dt, salt=root), f"broadcast out= root {root} {tag}")
        x = np.concatenate([data(rank, count, dt, salt=10 * j) for j in range(size)])
        want = np.concatenate([data(j, count, dt, salt=10 * rank) for j in range(size)])
        _same(comm.alltoall(x), want, f"alltoall {tag}")
        comm.alltoall(x, out=x)
        _same(x, want, f"alltoall in place {tag}")
        # every pair (a < b) in one global order: a sends then receives, b the reverse
        for a in range(size):
            for b in range(a + 1, size):
                if rank in (a, b):
                    peer = b if rank == a else a
                    got = np.empty(count, dtype=np_dtype(dt))
                    if rank == a:
                        comm.send(data(rank, count, dt, salt=peer), peer, tag=7)
                        comm.recv(got, peer, tag=7)
                    else:
                        comm.recv(got, peer, tag=7)
                        comm.send(data(rank, count, dt, salt=peer), peer, tag=7)
                    _same(got, data(peer, count, dt, salt=rank), f"send/recv {a}<->{b} {tag}")
        comm.barrier()
        n += 7
    return n


def asynchronous(comm):
    """async_op handles complete in order and keep their results."""
    rank, size = comm.rank, comm.size
    xs = [data(rank, 33, "float32", salt=i) for i in range(4)]
    hs = [comm.allreduce(x, out=x, async_op=True) for x in xs]
    g = comm.allgather(np.full(3, rank, dtype=np.int32), async_op=True)
    b = comm.barrier(async_op=True)
    for i, h in enumerate(hs):
        want = sum(data(r, 33, "float32", salt=i).astype(np.float64) for r in range(size))
        _same(h.wait(timeout=60), want.astype(np.float32), f"rank {rank}: async allreduce {i}")
    _same(g.wait(), np.repeat(np.arange(size, dtype=np.int32), 3).reshape(size, 3), "async allgather")
    assert b.wait() is None and b.done()
    return 6


def exchange(comm, k=3001):
    """send/recv in flight together: every rank posts a receive from every other and sends to every
    other (all async), then a ring where each rank posts its receive and then sends with a blocking
    call: neither may wait on its peer doing the same (engine.h p2p_start between hosts)."""
    rank, size = comm.rank, comm.size

    def value(src, dst):
        return (1000 * src + 10 * dst + np.arange(k)) % 65521

    outs = {p: np.zeros(k, np.int64) for p in range(size) if p != rank}
    hs = [comm.recv(outs[p], p, tag=21, async_op=True) for p in outs]
    hs += [comm.send(value(rank, p).astype(np.int64), p, tag=21, async_op=True) for p in outs]
    for h in hs:
        h.wait(timeout=60)
    for p, got in outs.items():
        _same(got, value(p, rank), f"rank {rank}: exchange from {p}")
    left, right = (rank - 1) % size, (rank + 1) % size
    ring = np.zeros(k, np.int64)
    h = comm.recv(ring, left, tag=22, async_op=True)
    comm.send(value(rank, right).astype(np.int64), right, tag=22)
    h.wait(timeout=60)
    _same(ring, value(left, rank), f"rank {rank}: ring from {left}")
    # the same ring with an allreduce between each receive and its send: the receive in flight
    # must not hold back the collective (core/p2p.cc parks it), nor the collective the receive
    h = comm.recv(ring, left, tag=23, async_op=True)
    x = np.full(5, rank + 1, np.int64)
    comm.allreduce(x, out=x)
    comm.send(value(rank, right).astype(np.int64), right, tag=23)
    h.wait(timeout=60)
    _same(ring, value(left, rank), f"rank {rank}: ring around an allreduce from {left}")
    _same(x, np.full(5, size * (size + 1) // 2, np.int64), f"rank {rank}: allreduce inside the ring")
    return len(outs) + 1


def capi_recv_any(comm, out, tag):
    """A recv from any rank through the C API (capi.h), which reports the sender: task_peer."""
    import ctypes
    import threading

    from test_capi import _call, _host, _pointer, _table  # noqa: F401 - _call: the table's layout

    from plait import _C

    t = _table()
    c = _pointer(_C._comm_capsule(comm._c), b"plait.Communicator")
    done = threading.Event()
    kinds = []

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_char_p)
    def on_done(_ctx, kind, _msg):
        kinds.append(kind)
        done.set()

    task = ctypes.c_void_p()
    err = ctypes.create_string_buffer(512)
    empty = _host(np.zeros(0, dtype=np.int64))
    empty.present = 0
    recv = _C.COLLECTIVES["recv"]
    kind = t.call(
        c,
        recv,
        ctypes.byref(empty),
        ctypes.byref(_host(out)),
        0,
        0,
        -1,
        tag,
        b"",
        -1.0,
        on_done,
        None,
        ctypes.byref(task),
        err,
        512,
    )
    assert kind == 0, err.value
    assert done.wait(60) and kinds == [0], kinds
    peer = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(t.task_peer)(task)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(t.task_release)(task)
    return peer


def any_source(comm, big=5000):
    """Rank 0 receives from any rank, on this host and others, mixed with named receives and other
    tags: every message arrives exactly once, each sender's in its order, with its sender reported
    (through the C API). Every other rank sends, in this order: tag 5 (k=0), tag 6, tag 5 (k=1),
    tag 7 (zero bytes), tag 8 (`big` int32: several staging chunks and engine pieces)."""
    rank, n = comm.rank, comm.size
    others = list(range(1, n))
    if rank:
        comm.send(np.full(4, 100 * rank, dtype=np.int64), 0, tag=5)
        comm.send(np.arange(3, dtype=np.int64) + 1000 * rank, 0, tag=6)
        comm.send(np.full(4, 100 * rank + 1, dtype=np.int64), 0, tag=5)
        comm.send(np.zeros(0, dtype=np.int64), 0, tag=7)
        comm.send(np.arange(big, dtype=np.int32) + 10**6 * rank, 0, tag=8)
        comm.barrier()
        return 1
    six = np.zeros(3, dtype=np.int64)
    comm.recv(six, n - 1, tag=6)  # named, before the any-source ones: it takes only its own
    _same(six, np.arange(3) + 1000 * (n - 1), "named recv of tag 6")
    seen = {r: [] for r in others}
    for k in range(2 * (n - 1)):
        got = np.zeros(4, dtype=np.int64)
        if k % 2:
            comm.recv(got, -1, tag=5)
            src = int(got[0]) // 100
        else:
            src = capi_recv_any(comm, got, 5)
            assert src == int(got[0]) // 100, (src, got)
        assert src in seen and len(set(got.tolist())) == 1, (src, got)
        seen[src].append(int(got[0]) % 100)
    assert all(v == [0, 1] for v in seen.values()), seen  # each sender's two, once, in order
    for r in others[:-1]:
        comm.recv(six, r, tag=6)
        _same(six, np.arange(3) + 1000 * r, f"named recv of tag 6 from {r}")
    empties = [capi_recv_any(comm, np.zeros(0, dtype=np.int64), 7) for _ in others]
    assert sorted(empties) == others, empties
    senders = []
    for _ in others:
        got = np.zeros(big, dtype=np.int32)
        comm.recv(got, -1, tag=8)
        src = int(got[0]) // 10**6
        senders.append(src)
        _same(got, np.arange(big, dtype=np.int32) + 10**6 * src, f"any-source tag 8 from {src}")
    assert sorted(senders) == others, senders
    comm.barrier()
    return 4 * (n - 1)
