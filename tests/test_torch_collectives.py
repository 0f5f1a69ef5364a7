"""Every c10d collective through backend "plait", every op and dtype, against closed-form values.

Rank r's data is a small integer formula of (r, i), so every summation order gives the same
float and results compare exactly (assert_close with zero tolerance). One fork per world size
runs the whole matrix inside a single process group; each rank collects wrong results instead
of stopping, so the ranks stay in step and a failure lists every wrong case.
"""

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from test_torch_backend import init_pg, run_torch  # noqa: E402

R = dist.ReduceOp
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
UINTS = [torch.uint16, torch.uint32, torch.uint64]
COMPLEX = [torch.complex64, torch.complex128]
N = 37  # elements per tensor: odd, not a multiple of a vector width


def data(r, dtype, n=N, shape=None):
    """Rank r's tensor: small integers (bool: a pattern) that every dtype holds exactly."""
    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        v = ((i + r) % 3) == 0
    elif dtype.is_complex:
        v = torch.complex((r + 1) * (i % 5 + 1.0), (r - 1) * (i % 3 + 0.0)).to(dtype)
    elif dtype in UINTS or dtype == torch.uint8:
        v = ((r + 1) * (i % 5 + 1)).to(dtype)
    else:  # signed: some negative values
        v = ((r + 1) * (i % 5 + 1) - 3).to(dtype)
    return v if shape is None else v.reshape(shape)


def reference(stack, op, n, dtype, factor=None):
    """The reduction of a (ranks, ...) stack, computed the slow, obvious way."""
    if dtype.is_complex:
        s = stack.to(torch.complex128)
        out = {R.SUM: s.sum(0), R.AVG: s.sum(0) / n}.get(op)
        if op == R.PREMUL_SUM:
            out = (s * factor).sum(0)
        return out.to(dtype)
    if dtype == torch.bool:
        fns = {
            R.SUM: lambda s: s.any(0),
            R.MAX: lambda s: s.any(0),
            R.PRODUCT: lambda s: s.all(0),
            R.MIN: lambda s: s.all(0),
            R.BAND: lambda s: s.all(0),
            R.BOR: lambda s: s.any(0),
            R.BXOR: lambda s: s.to(torch.int64).sum(0) % 2 == 1,
        }
        return fns[op](stack)
    wide = stack.to(torch.float64 if dtype.is_floating_point else torch.int64)
    if op == R.SUM:
        out = wide.sum(0)
    elif op == R.PREMUL_SUM:
        out = (wide * factor).sum(0) if dtype.is_floating_point else (wide * int(factor)).sum(0)
    elif op == R.PRODUCT:
        out = wide.prod(0)
    elif op == R.MIN:
        out = wide.min(0).values
    elif op == R.MAX:
        out = wide.max(0).values
    elif op == R.AVG:
        out = wide.sum(0) / n if dtype.is_floating_point else torch.div(wide.sum(0), n, rounding_mode="trunc")
    else:
        fn = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[op]
        out = stack[0].to(torch.int64)
        for t in stack[1:]:
            out = fn(out, t.to(torch.int64))
    if dtype in INTS + UINTS and dtype != torch.int64:
        bits = torch.iinfo(dtype).bits
        out = out & ((1 << bits) - 1)  # wrap like the dtype's own arithmetic
        if dtype.is_signed:
            out = torch.where(out >= 1 << (bits - 1), out - (1 << bits), out)
    return out.to(dtype)


def op_dtype_matrix():
    cases = []
    for dt in FLOATS:
        cases += [(dt, op) for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.PREMUL_SUM)]
    for dt in INTS:
        cases += [
            (dt, op) for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.PREMUL_SUM, R.BAND, R.BOR, R.BXOR)
        ]
    cases += [(torch.bool, op) for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR)]
    cases += [(dt, op) for dt in COMPLEX for op in (R.SUM, R.AVG, R.PREMUL_SUM)]
    cases += [
        (torch.uint16, R.SUM),
        (torch.uint32, R.SUM),
        (torch.uint64, R.SUM),
        (torch.uint16, R.MAX),
        (torch.uint32, R.MIN),
        (torch.uint64, R.PRODUCT),
    ]
    return cases


class Checker:
    def __init__(self, rank):
        self.rank, self.wrong = rank, []

    def eq(self, got, want, what):
        try:
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        except AssertionError as e:
            self.wrong.append(
                f"rank {self.rank}: {what}: {str(e).splitlines()[0]}\n  got {got}\n  want {want}"
            )

    def done(self):
        assert not self.wrong, "\n".join(self.wrong[:20]) + f"\n({len(self.wrong)} wrong)"


def _op_arg(op, factor):
    return dist._make_nccl_premul_sum(factor) if op == R.PREMUL_SUM else op


def reductions(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    c = Checker(rank)
    for dt, op in op_dtype_matrix():
        factor = 2.0
        want = reference(torch.stack([data(r, dt) for r in range(n)]), op, n, dt, factor)
        what = f"{dt} {op}"
        x = data(rank, dt)
        dist.all_reduce(x, op=_op_arg(op, factor))
        c.eq(x, want, "all_reduce " + what)
        # async, and a non-contiguous view with its neighbours checked untouched
        big = torch.stack([data(rank, dt), data(rank + 7, dt)], 1)  # (N, 2): column 0 is ours
        w = dist.all_reduce(big[:, 0], op=_op_arg(op, factor), async_op=True)
        w.wait()
        c.eq(big[:, 0], want, "async strided all_reduce " + what)
        c.eq(big[:, 1], data(rank + 7, dt), "neighbour column of " + what)
        # reduce to root 1 % n; other ranks keep their tensor
        y = data(rank, dt)
        dist.reduce(y, dst=1 % n, op=_op_arg(op, factor))
        c.eq(y, want if rank == 1 % n else data(rank, dt), "reduce " + what)
        # reduce_scatter_tensor: rank r gets block r of the reduction of (n*N) inputs
        xs = torch.cat([data(rank * 3 + b, dt) for b in range(n)])
        full = reference(
            torch.stack([torch.cat([data(r * 3 + b, dt) for b in range(n)]) for r in range(n)]),
            op,
            n,
            dt,
            factor,
        )
        out = torch.empty(N, dtype=dt)
        dist.reduce_scatter_tensor(out, xs, op=_op_arg(op, factor))
        c.eq(out, full[rank * N : (rank + 1) * N], "reduce_scatter_tensor " + what)
        out2 = torch.empty(N, dtype=dt)
        dist.reduce_scatter(out2, list(xs.clone().chunk(n)), op=_op_arg(op, factor))
        c.eq(out2, full[rank * N : (rank + 1) * N], "reduce_scatter " + what)
    # PREMUL_SUM with a tensor factor, and in-place reduce_scatter (output is the input's block)
    x = data(rank, torch.float32)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(torch.tensor([0.5])))
    c.eq(
        x,
        reference(
            torch.stack([data(r, torch.float32) for r in range(n)]), R.PREMUL_SUM, n, torch.float32, 0.5
        ),
        "premul with tensor factor",
    )
    xs = torch.cat([data(rank * 3 + b, torch.float32) for b in range(n)])
    full = torch.stack([torch.cat([data(r * 3 + b, torch.float32) for b in range(n)]) for r in range(n)]).sum(
        0
    )
    dist.reduce_scatter_tensor(xs[rank * N : (rank + 1) * N], xs)
    c.eq(xs[rank * N : (rank + 1) * N], full[rank * N : (rank + 1) * N], "in-place reduce_scatter_tensor")
    # output overlapping the input somewhere else than its own block: the input is read first
    xs = torch.cat([data(rank * 3 + b, torch.float32) for b in range(n)])
    other = (rank + 1) % n
    dist.reduce_scatter_tensor(xs[other * N : (other + 1) * N], xs)
    c.eq(
        xs[other * N : (other + 1) * N],
        full[rank * N : (rank + 1) * N],
        "reduce_scatter_tensor into another block",
    )
    # coalesced all_reduce of several shapes
    shapes = [(torch.float32, 6, (2, 3)), (torch.float32, 5, None), (torch.float32, 0, None)]
    ts = [data(rank, dt, k, shp) for dt, k, shp in shapes]
    dist.all_reduce_coalesced(ts)
    for t, (dt, k, shp) in zip(ts, shapes):
        c.eq(
            t,
            torch.stack([data(r, dt, k, shp) for r in range(n)]).sum(0).to(dt),
            f"all_reduce_coalesced {dt}",
        )
    # 0-d and empty tensors
    z = torch.tensor(float(rank + 1))
    dist.all_reduce(z, op=R.MAX)
    c.eq(z, torch.tensor(float(n)), "0-d all_reduce")
    e = torch.empty(0)
    dist.all_reduce(e)
    dist.destroy_process_group()
    c.done()


def movement(rank, n, store_dir):
    init_pg("plait", rank, n, store_dir)
    c = Checker(rank)
    for dt in FLOATS + INTS + UINTS + COMPLEX + [torch.bool, torch.float8_e4m3fn]:
        what = str(dt)
        mk = (
            (lambda r, k=N, dt=dt: data(r, dt, k))
            if dt != torch.float8_e4m3fn
            else (lambda r, k=N, dt=dt: data(r, torch.float32, k).to(dt))
        )
        eqv = (
            (lambda a, b: (a.view(torch.uint8), b.view(torch.uint8)))
            if dt == torch.float8_e4m3fn
            else (lambda a, b: (a, b))
        )
        # broadcast from the last rank, in place
        b = mk(rank)
        dist.broadcast(b, src=n - 1)
        c.eq(*eqv(b, mk(n - 1)), "broadcast " + what)
        # all_gather into a list and into one tensor, and the in-place form
        outs = [torch.empty(N, dtype=dt) for _ in range(n)]
        dist.all_gather(outs, mk(rank))
        for r in range(n):
            c.eq(*eqv(outs[r], mk(r)), f"all_gather[{r}] " + what)
        flat = torch.empty(n * N, dtype=dt)
        dist.all_gather_into_tensor(flat, mk(rank))
        c.eq(*eqv(flat, torch.cat([mk(r) for r in range(n)])), "all_gather_into_tensor " + what)
        flat2 = torch.empty(n * N, dtype=dt)
        flat2[rank * N : (rank + 1) * N] = mk(rank)
        dist.all_gather_into_tensor(flat2, flat2[rank * N : (rank + 1) * N])
        c.eq(*eqv(flat2, torch.cat([mk(r) for r in range(n)])), "in-place all_gather_into_tensor " + what)
        # all_to_all_single, even: block j of rank r's input is mk(10*r + j)
        src = torch.cat([mk(10 * rank + j) for j in range(n)])
        out = torch.empty_like(src)
        dist.all_to_all_single(out, src)
        c.eq(*eqv(out, torch.cat([mk(10 * j + rank) for j in range(n)])), "all_to_all_single " + what)
        dist.all_to_all_single(src, src)  # in place
        c.eq(
            *eqv(src, torch.cat([mk(10 * j + rank) for j in range(n)])), "in-place all_to_all_single " + what
        )
        # gather / scatter to and from rank 0
        gl = [torch.empty(N, dtype=dt) for _ in range(n)] if rank == 0 else None
        dist.gather(mk(rank), gl, dst=0)
        if rank == 0:
            for r in range(n):
                c.eq(*eqv(gl[r], mk(r)), f"gather[{r}] " + what)
        so = torch.empty(N, dtype=dt)
        dist.scatter(so, [mk(20 + r) for r in range(n)] if rank == 0 else None, src=0)
        c.eq(*eqv(so, mk(20 + rank)), "scatter " + what)
    # uneven all_to_all_single: rank r sends (r + j + 1) rows of 3 to rank j
    rows = lambda r, j: r + j + 1  # noqa: E731
    ins = [torch.full((rows(rank, j), 3), 100 * rank + j, dtype=torch.int32) for j in range(n)]
    out = torch.empty((sum(rows(j, rank) for j in range(n)), 3), dtype=torch.int32)
    dist.all_to_all_single(
        out,
        torch.cat(ins),
        output_split_sizes=[rows(j, rank) for j in range(n)],
        input_split_sizes=[rows(rank, j) for j in range(n)],
    )
    c.eq(
        out,
        torch.cat([torch.full((rows(j, rank), 3), 100 * j + rank, dtype=torch.int32) for j in range(n)]),
        "uneven all_to_all_single",
    )
    # uneven, with zero-row splits and async
    zs = [0 if (rank + j) % 2 else 2 for j in range(n)]
    zr = [0 if (j + rank) % 2 else 2 for j in range(n)]
    src = torch.cat([torch.full((zs[j],), float(rank * 10 + j)) for j in range(n)])
    out = torch.empty(sum(zr))
    dist.all_to_all_single(out, src, zr, zs, async_op=True).wait()
    c.eq(
        out,
        torch.cat([torch.full((zr[j],), float(j * 10 + rank)) for j in range(n)]),
        "zero-split all_to_all_single",
    )
    # all_to_all with lists of different sizes
    ins = [torch.full((j + 1,), float(rank * 10 + j)) for j in range(n)]
    outs = [torch.empty(rank + 1) for j in range(n)]
    dist.all_to_all(outs, ins)
    for j in range(n):
        c.eq(outs[j], torch.full((rank + 1,), float(j * 10 + rank)), f"uneven all_to_all[{j}]")
    ins = [torch.full((4,), float(rank * 10 + j)) for j in range(n)]
    outs = [torch.empty(4) for _ in range(n)]
    dist.all_to_all(outs, ins)
    for j in range(n):
        c.eq(outs[j], torch.full((4,), float(j * 10 + rank)), f"all_to_all[{j}]")
    # all_gather with uneven sizes
    outs = [torch.empty(r + 1, dtype=torch.int64) for r in range(n)]
    dist.all_gather(outs, torch.arange(rank + 1) * (rank + 1))
    for r in range(n):
        c.eq(outs[r], torch.arange(r + 1) * (r + 1), f"uneven all_gather[{r}]")
    # all_gather into non-contiguous outputs (columns of one matrix)
    m = torch.zeros(N, n + 1)
    dist.all_gather([m[:, r] for r in range(n)], data(rank, torch.float32))
    for r in range(n):
        c.eq(m[:, r], data(r, torch.float32), f"strided all_gather[{r}]")
    c.eq(m[:, n], torch.zeros(N), "column after the strided all_gather outputs")
    # send / recv with tags, around the ring, blocking and non-blocking; batch_isend_irecv
    if n > 1:
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        got = torch.empty(5, dtype=torch.float64)
        reqs = [
            dist.isend(torch.full((5,), rank + 0.5, dtype=torch.float64), nxt, tag=7),
            dist.irecv(got, prv, tag=7),
        ]
        for q in reqs:
            q.wait()
        c.eq(got, torch.full((5,), prv + 0.5, dtype=torch.float64), "isend/irecv")
        big = torch.arange(300_000, dtype=torch.float32) + rank
        gotbig = torch.empty_like(big)
        ops = [dist.P2POp(dist.irecv, gotbig, prv, tag=3), dist.P2POp(dist.isend, big, nxt, tag=3)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        c.eq(gotbig, torch.arange(300_000, dtype=torch.float32) + prv, "batch_isend_irecv of 1.2 MB")
        if rank == 0:
            dist.send(torch.tensor([1, 2, 3]), 1, tag=11)
        elif rank == 1:
            t = torch.empty(3, dtype=torch.int64)
            dist.recv(t, 0, tag=11)
            c.eq(t, torch.tensor([1, 2, 3]), "send/recv")
    # object collectives
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    c.eq(torch.tensor([o["rank"] for o in objs]), torch.arange(n), "all_gather_object")
    lst = [f"from {rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    c.eq(torch.tensor(lst[1]), torch.tensor(0), "broadcast_object_list")
    go = [None] * n if rank == 0 else None
    dist.gather_object(rank * 2, go, dst=0)
    if rank == 0:
        c.eq(torch.tensor(go), torch.arange(n) * 2, "gather_object")
    so = [None]
    dist.scatter_object_list(so, [r * 3 for r in range(n)] if rank == 0 else None, src=0)
    c.eq(torch.tensor(so[0]), torch.tensor(rank * 3), "scatter_object_list")
    # coalesced all_gather of different dtypes (old API), barrier, async barrier
    outs = [[torch.empty(2), torch.empty(3, dtype=torch.int8)] for _ in range(n)]
    pg = dist.group.WORLD
    pg.allgather_coalesced(
        outs, [torch.full((2,), rank + 0.25), torch.full((3,), rank, dtype=torch.int8)]
    ).wait()
    for r in range(n):
        c.eq(outs[r][0], torch.full((2,), r + 0.25), f"allgather_coalesced[{r}][0]")
        c.eq(outs[r][1], torch.full((3,), r, dtype=torch.int8), f"allgather_coalesced[{r}][1]")
    dist.barrier()
    dist.barrier(async_op=True).wait()
    old_names_and_coalesced(c, rank, n)
    dist.destroy_process_group()
    c.done()


def old_names_and_coalesced(c, rank, n):
    """The pre-2.13 method names, called directly, and the coalescing manager's fast paths."""
    pg = dist.group.WORLD
    out = torch.empty(2 * n)
    pg._allgather_base(out, torch.full((2,), float(rank))).wait()
    c.eq(out, torch.arange(n, dtype=torch.float32).repeat_interleave(2), "_allgather_base")
    rs = torch.empty(2)
    o = dist.ReduceScatterOptions()
    o.reduceOp = dist.ReduceOp.MAX
    pg._reduce_scatter_base(rs, torch.arange(2.0 * n) + rank, o).wait()
    c.eq(rs, torch.arange(2.0 * rank, 2.0 * rank + 2) + n - 1, "_reduce_scatter_base MAX")
    a2a = torch.empty(n)
    pg.alltoall_base(a2a, torch.arange(float(n)) + 10 * rank, [], [], dist.AllToAllOptions()).wait()
    c.eq(a2a, torch.arange(n) * 10.0 + rank, "alltoall_base")
    outs = [torch.empty(n), torch.empty(2 * n, dtype=torch.int64)]
    pg.allgather_into_tensor_coalesced(outs, [torch.full((1,), float(rank)), torch.full((2,), rank)]).wait()
    c.eq(outs[0], torch.arange(float(n)), "allgather_into_tensor_coalesced[0]")
    c.eq(outs[1], torch.arange(n).repeat_interleave(2), "allgather_into_tensor_coalesced[1]")
    outs = [torch.empty(1), torch.empty(2)]
    o = dist.ReduceScatterOptions()
    o.reduceOp = dist.ReduceOp.AVG
    pg.reduce_scatter_tensor_coalesced(outs, [torch.ones(n) * rank, torch.ones(2 * n) * rank], o).wait()
    c.eq(outs[0], torch.full((1,), (n - 1) / 2), "reduce_scatter_tensor_coalesced[0] AVG")
    c.eq(outs[1], torch.full((2,), (n - 1) / 2), "reduce_scatter_tensor_coalesced[1] AVG")
    # dist._coalescing_manager without a device takes the fast paths above
    a, b = torch.empty(n), torch.empty(3 * n)
    with dist.distributed_c10d._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(a, torch.full((1,), float(rank)))
        dist.all_gather_into_tensor(b, torch.full((3,), float(rank)))
    cm.wait()
    c.eq(a, torch.arange(float(n)), "coalesced all_gather_into_tensor[0]")
    c.eq(b, torch.arange(float(n)).repeat_interleave(3), "coalesced all_gather_into_tensor[1]")
    x, y = torch.empty(1), torch.empty(2)
    with dist.distributed_c10d._coalescing_manager():
        dist.reduce_scatter_tensor(x, torch.ones(n))
        dist.reduce_scatter_tensor(y, torch.ones(2 * n))
    c.eq(x, torch.full((1,), float(n)), "coalesced reduce_scatter_tensor[0]")
    c.eq(y, torch.full((2,), float(n)), "coalesced reduce_scatter_tensor[1]")
    # overlapping outputs of different gathers must not corrupt each other: two views of one buffer
    buf = torch.zeros(4 * n)
    w1 = dist.all_gather_into_tensor(buf[: 2 * n], torch.full((2,), rank + 1.0), async_op=True)
    w2 = dist.all_gather_into_tensor(buf[2 * n :], torch.full((2,), -rank - 1.0), async_op=True)
    w2.wait(timeout=__import__("datetime").timedelta(seconds=30))
    w1.wait()
    want = torch.cat(
        [torch.arange(1.0, n + 1).repeat_interleave(2), -torch.arange(1.0, n + 1).repeat_interleave(2)]
    )
    c.eq(buf, want, "two gathers into halves of one buffer")


@pytest.mark.parametrize("n", [2, 3])
def test_reductions(n, tmp_path):
    run_torch(reductions, n, tmp_path, timeout=120)


@pytest.mark.parametrize("n", [2, 3])
def test_data_movement(n, tmp_path):
    run_torch(movement, n, tmp_path, timeout=120)


def test_one_rank(tmp_path):
    run_torch(reductions, 1, tmp_path, timeout=60)
    run_torch(movement, 1, tmp_path / "m", timeout=60)
