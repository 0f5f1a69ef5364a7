"""One small descriptor per collective, after nccl-tests' src/*.cu: how a size in bytes becomes
element counts, what each rank sends, what it must get back, the bus-bandwidth factor, and which
buffers an in-place or out-of-place call uses.

Sizes follow nccl-tests: `bytes` is the whole buffer (for reduce_scatter the full input, for
allgather the full output, for alltoall either buffer) and `count` is its elements, so algbw =
bytes / time. Data is integer-valued and pseudo-random from a closed formula of (seed, rank,
index), so every rank can compute every other rank's input and compare exactly.
"""

import numpy as np

from plait._arrays import DTYPES as DTYPE_TABLE

# Largest integer whose sums stay exact (floats) or that fits the type (integers: wrap-around is
# the same in numpy and in plait, so only the values must fit).
_EXACT = {
    "float16": 2048,
    "bfloat16": 256,
    "float32": 1 << 24,
    "float64": 1 << 24,
    "int8": 127,
    "uint8": 255,
    "int32": 1 << 24,
    "int64": 1 << 24,
    "bool": 2,
}
_STORAGE = {name: np.dtype(ts).type for name, ts in DTYPE_TABLE.items()}  # plait's one table
DTYPES = tuple(_STORAGE)
OPS = ("sum", "prod", "min", "max", "avg")


def itemsize(dtype):
    return np.dtype(_STORAGE[dtype]).itemsize


def storage(dtype):
    """numpy dtype of the buffers (bfloat16 travels as raw uint16 bits, as plait accepts it)."""
    return _STORAGE[dtype]


class Data:
    """The closed-form input values for one (dtype, op, world size, seed)."""

    def __init__(self, dtype, op, n, seed):
        if op == "avg" and not dtype.startswith(("float", "bfloat")):
            raise ValueError(f"op avg needs a float dtype, not {dtype}")
        self.dtype, self.op, self.n, self.seed = dtype, op, n, seed
        lim = _EXACT[dtype]
        # Bounds that keep every reduced value exact: sums of n values, avg's sums of multiples of n
        # (so the division is exact), products of 1s and 2s (powers of two are exact).
        if dtype == "bool" or op == "prod":
            self.k, self.scale = 2, 1
        elif op == "sum":
            self.k, self.scale = max(1, lim // n), 1
        elif op == "avg":
            self.k, self.scale = max(1, lim // (n * n)), n
        else:
            self.k, self.scale = lim, 1

    def values(self, rank, offset, count):
        """int64 values in scale*[1, k] of rank's logical data at [offset, offset + count)."""
        i = np.arange(offset, offset + count, dtype=np.uint32)
        h = i * np.uint32(0x9E3779B1) + np.uint32((rank * 0x85EBCA77 + self.seed * 0xC2B2AE3D) & 0xFFFFFFFF)
        h ^= h >> np.uint32(15)
        h *= np.uint32(0x2C1B3C6D)
        h ^= h >> np.uint32(12)
        v = (h % np.uint32(self.k)).astype(np.int64) + 1
        return v * self.scale if self.scale != 1 else v

    def reduced(self, offset, count):
        """The op over all ranks' values, as int64 (bool: 1 = false, 2 = true)."""
        op = self.op
        if self.dtype == "bool":  # sum and max are `or`, prod and min are `and`
            op = "max" if op in ("sum", "max") else "min"
        acc = self.values(0, offset, count)
        for r in range(1, self.n):
            v = self.values(r, offset, count)
            if op in ("sum", "avg"):
                acc += v
            elif op == "prod":
                acc *= v
            elif op == "min":
                np.minimum(acc, v, out=acc)
            else:
                np.maximum(acc, v, out=acc)
        return acc // self.n if op == "avg" else acc

    def encode(self, v):
        """int64 values -> buffer contents (exact; integers wrap as numpy and plait wrap)."""
        if self.dtype == "bool":
            return v > 1
        if self.dtype == "bfloat16":  # small integers are exact in bfloat16: keep the top 16 bits
            return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return v.astype(_STORAGE[self.dtype])


def count_wrong(got, expected):
    """Elements that differ (bit-exact for floats: the data make every result exact)."""
    if got is None or expected is None:
        return 0
    return int(np.count_nonzero(got.reshape(-1) != expected.reshape(-1)))


class Collective:
    """A collective's arithmetic. Subclasses say what goes in, what must come out, and where."""

    name = ""
    reduces = True  # takes an op (otherwise redop prints "none")
    rooted = False  # has a root (otherwise root prints -1)
    blocked = False  # the buffer is n equal blocks, so count is rounded down to a multiple of n

    def busbw_factor(self, n):
        return (n - 1) / n

    def count(self, nbytes, dtype, n):
        c = nbytes // itemsize(dtype)
        return c // n * n if self.blocked else c

    def send_count(self, count, n):
        return count

    def recv_count(self, count, n):
        return count

    def input(self, data, rank, count):
        return data.values(rank, 0, self.send_count(count, data.n))

    def expected(self, data, rank, count, root):
        raise NotImplementedError

    def views(self, send, recv, rank, n, root, inplace):
        """(x, out, result): the call's arguments and where its result lands on this rank.
        In place, the input is written into x first (the harness copies it there)."""
        return (recv, recv, recv) if inplace else (send, recv, recv)


class AllReduce(Collective):
    name = "allreduce"

    def busbw_factor(self, n):
        return 2 * (n - 1) / n

    def expected(self, data, rank, count, root):
        return data.reduced(0, count)


class ReduceScatter(Collective):
    name, blocked = "reduce_scatter", True

    def recv_count(self, count, n):
        return count // n

    def expected(self, data, rank, count, root):
        m = count // data.n
        return data.reduced(rank * m, m)

    def views(self, send, recv, rank, n, root, inplace):
        if not inplace:
            return send, recv, recv
        m = send.size // n
        block = send[rank * m : (rank + 1) * m]  # NCCL's in place: the output is my block of x
        return send, block, block


class AllGather(Collective):
    name, reduces, blocked = "allgather", False, True

    def send_count(self, count, n):
        return count // n

    def expected(self, data, rank, count, root):
        m = count // data.n
        return np.concatenate([data.values(r, 0, m) for r in range(data.n)])

    def views(self, send, recv, rank, n, root, inplace):
        if not inplace:
            return send, recv, recv
        m = recv.size // n
        return recv[rank * m : (rank + 1) * m], recv, recv  # x is my block of out


class Broadcast(Collective):
    name, reduces, rooted = "broadcast", False, True

    def busbw_factor(self, n):
        return 1.0

    def expected(self, data, rank, count, root):
        return data.values(root, 0, count)


class Reduce(Collective):
    name, rooted = "reduce", True

    def busbw_factor(self, n):
        return 1.0

    def expected(self, data, rank, count, root):
        return data.reduced(0, count) if rank == root else None

    def views(self, send, recv, rank, n, root, inplace):
        mine = recv if rank == root else None
        return (recv, mine, mine) if inplace else (send, mine, mine)


class AllToAll(Collective):
    name, reduces, blocked = "alltoall", False, True

    def expected(self, data, rank, count, root):
        m = count // data.n  # block j came from rank j: its block for me
        return np.concatenate([data.values(j, rank * m, m) for j in range(data.n)])


COLLECTIVES = {
    c.name: c for c in (AllReduce(), ReduceScatter(), AllGather(), Broadcast(), Reduce(), AllToAll())
}
