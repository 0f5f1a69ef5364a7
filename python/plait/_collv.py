"""gather, scatter, allgatherv, alltoallv and the object collectives, built on a communicator's own
collectives (so the flat and the hierarchical communicator share them).

Each call first allgathers one small int64 record per rank (what it was called with: which
collective, root, dtype, trailing shape, counts). Every rank then holds every rank's record and
checks them all the same way, so arguments that disagree across ranks (counts, dtype, root) raise
the same error on every rank, naming the ranks, instead of a hang or wrong data. Data then moves as
raw bytes (any dtype): gather and scatter with send/recv to and from the root; allgatherv in one
allgather padded to the largest block when the counts are nearly even, else as one broadcast per
rank with data (exactly the bytes each rank contributes); alltoallv in one alltoall padded to the
largest block.
"""

from __future__ import annotations

import pickle
import zlib
from typing import Any, Optional, Sequence

import numpy as np

from . import _arrays
from ._errors import InvalidArgument, MismatchError

_KIND = {"gather": 1, "scatter": 2, "allgatherv": 3, "alltoallv": 4}
_NONE = -1  # "not given" in a record


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


def _array(x: Any, what: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    if hasattr(x, "__array_interface__") or hasattr(x, "numpy"):
        return np.ascontiguousarray(_arrays.to_numpy(x, what)[0])
    raise InvalidArgument(f"{what} must be a numpy array or a torch CPU tensor, got {type(x).__name__}")


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _head(kind, root, a, counts=(), extra=()):
    """This rank's record: kind, root, dtype, trailing shape, row count, then counts and extra."""
    dt = _code(a.dtype.name) if a is not None else _NONE
    trail = _code(repr(tuple(a.shape[1:]))) if a is not None else _NONE
    rows = a.shape[0] if a is not None and a.ndim else (_NONE if a is None else 1)
    return [_KIND[kind], root, dt, trail, rows, *counts, *extra]


def _exchange(comm, record):
    mine = np.asarray(record, dtype=np.int64)
    return comm.allgather(mine)


def _agree(table, column, what, name, ranks=None):
    """Every rank in `ranks` (default: all) has the same value in `column`, else MismatchError."""
    ranks = range(len(table)) if ranks is None else ranks
    vals = {r: int(table[r, column]) for r in ranks}
    if len(set(vals.values())) > 1:
        first = next(iter(vals))
        bad = [r for r, v in vals.items() if v != vals[first]]
        raise MismatchError(f"{name}: ranks disagree on {what}: rank {first} differs from rank(s) {bad}")


def _raise_flagged(table, column, name, problems, rank):
    """A problem found on one rank is an error on every rank: its flag travels in the records."""
    bad = [r for r in range(len(table)) if table[r, column]]
    if bad:
        if rank in bad:
            raise InvalidArgument(f"rank {rank}: {name}: {problems}")
        raise InvalidArgument(f"rank {rank}: {name}: invalid arguments on rank(s) {bad}")


def gather(comm, x: Any, root: int = 0) -> Optional[np.ndarray]:
    """Root gets an array of shape (size, *x.shape) whose row r is rank r's x; the others None.
    Every rank's x must have the same shape and dtype."""
    a = _array(x, "gather input")
    root = int(root)
    problem = None if 0 <= root < comm.size else f"root {root} is not a rank of {comm.size}"
    table = _exchange(comm, _head("gather", root, a, (_code(repr(a.shape)),), [problem is not None]))
    _raise_flagged(table, 6, "gather", problem, comm.rank)
    _agree(table, 0, "the collective (gather vs another v-collective)", "gather")
    _agree(table, 1, "root", "gather")
    _agree(table, 2, "dtype", "gather")
    _agree(table, 5, "the input shape", "gather")
    if comm.rank != root:
        if a.nbytes:
            comm.send(_bytes(a), root)
        return None
    out = np.empty((comm.size,) + a.shape, dtype=a.dtype)
    out[root] = a
    if a.nbytes:
        for r in range(comm.size):
            if r != root:
                comm.recv(_bytes(out[r]), r)
    return out


def scatter(comm, x: Any = None, root: int = 0) -> np.ndarray:
    """Row r of the root's x (shape (size, ...)) lands on rank r; other ranks' x is ignored."""
    root = int(root)
    a = _array(x, "scatter input") if comm.rank == root else None
    problem = None
    if not 0 <= root < comm.size:
        problem = f"root {root} is not a rank of {comm.size}"
    elif a is not None and (a.ndim == 0 or a.shape[0] != comm.size):
        problem = f"the root's input needs shape ({comm.size}, ...), got {a.shape}"
    shape = list(a.shape[1:]) if a is not None and a.ndim else []
    if len(shape) > 8:
        problem = problem or "scatter takes inputs of at most 9 dimensions"
    dims = [len(shape), *(shape + [0] * (8 - len(shape)))[:8]]
    table = _exchange(comm, _head("scatter", root, None, dims, [problem is not None]))
    _raise_flagged(table, 14, "scatter", problem, comm.rank)
    _agree(table, 0, "the collective (scatter vs another v-collective)", "scatter")
    _agree(table, 1, "root", "scatter")
    # The dtype travels as its name, in a broadcast of fixed size from the root.
    name = np.zeros(32, dtype=np.uint8)
    if a is not None:
        text = a.dtype.name.encode()[:32]
        name[: len(text)] = np.frombuffer(text, dtype=np.uint8)
    comm.broadcast(name, root)
    dtype = _dtype(name.tobytes().rstrip(b"\0").decode())
    n = int(table[root, 5])
    row_shape = tuple(int(d) for d in table[root, 6 : 6 + n])
    if comm.rank == root:
        for r in range(comm.size):
            if r != root and a[r].nbytes:
                comm.send(_bytes(a[r]), r)
        return a[root].copy()
    out = np.empty(row_shape, dtype=dtype)
    if out.nbytes:
        comm.recv(_bytes(out), root)
    return out


def _dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _counts(v, size, what):
    """A list of `size` non-negative ints, or an error text."""
    try:
        c = [int(i) for i in v]
    except (TypeError, ValueError):
        return None, f"{what} must be a sequence of {size} integers, got {v!r}"
    if len(c) != size:
        return None, f"{what} has {len(c)} entries, the communicator {size} ranks"
    if any(i < 0 for i in c):
        return None, f"{what} has a negative count: {c}"
    return c, None


def allgatherv(comm, x: Any, counts: Optional[Sequence[int]] = None) -> np.ndarray:
    """The concatenation along axis 0 of every rank's x (rank order); x.shape[0] may differ
    between ranks (0 included), the other dimensions and the dtype may not. `counts`, when given,
    is every rank's x.shape[0] as the caller expects it, checked on every rank."""
    return _allgatherv(comm, _array(x, "allgatherv input"), counts)[0]


def _allgatherv(comm, a, counts):
    """(the result, every rank's row count)."""
    if a.ndim == 0:
        a = a.reshape(1)
    problem, given = None, _NONE
    if counts is not None:
        c, problem = _counts(counts, comm.size, "counts")
        given = _code(repr(c)) if c is not None else _NONE
        if c is not None and c[comm.rank] != a.shape[0]:
            problem = f"counts[{comm.rank}] = {c[comm.rank]} but this rank's input has {a.shape[0]} rows"
    table = _exchange(comm, _head("allgatherv", 0, a, (given,), [problem is not None]))
    _raise_flagged(table, 6, "allgatherv", problem, comm.rank)
    _agree(table, 0, "the collective (allgatherv vs another v-collective)", "allgatherv")
    _agree(table, 2, "dtype", "allgatherv")
    _agree(table, 3, "the trailing dimensions of the input", "allgatherv")
    rows = [int(n) for n in table[:, 4]]
    named = [r for r in range(comm.size) if table[r, 5] != _NONE]
    if named and any(int(table[r, 5]) != _code(repr(rows)) for r in named):
        bad = [r for r in named if int(table[r, 5]) != _code(repr(rows))]
        raise MismatchError(f"allgatherv: the counts of rank(s) {bad} are not the ranks' row counts {rows}")
    out = np.empty((sum(rows),) + a.shape[1:], dtype=a.dtype)
    row_bytes = a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
    if not out.nbytes:
        return out, rows
    flat = _bytes(out)
    most = max(rows)
    if most * comm.size <= 1.25 * sum(rows):  # nearly even: one allgather, padding is cheap
        padded = np.zeros(most * row_bytes, dtype=np.uint8)
        padded[: a.nbytes] = _bytes(a)
        every = comm.allgather(padded).reshape(comm.size, -1)
        at = 0
        for r, n in enumerate(rows):
            flat[at : at + n * row_bytes] = every[r, : n * row_bytes]
            at += n * row_bytes
        return out, rows
    at = 0
    for r, n in enumerate(rows):
        piece = flat[at : at + n * row_bytes]
        if n:
            if r == comm.rank:
                piece[:] = _bytes(a)
            comm.broadcast(piece, r)
        at += n * row_bytes
    return out, rows


def alltoallv(
    comm, x: Any, send_counts: Sequence[int], recv_counts: Optional[Sequence[int]] = None
) -> np.ndarray:
    """Rows [sum(send_counts[:j]), sum(send_counts[:j+1])) of x go to rank j; the result holds what
    every rank sent here, in rank order. `recv_counts`, when given, is checked against what the
    other ranks send (on every rank)."""
    a = _array(x, "alltoallv input")
    if a.ndim == 0:
        a = a.reshape(1)
    size = comm.size
    send, problem = _counts(send_counts, size, "send_counts")
    if send is not None and sum(send) != a.shape[0]:
        problem = f"send_counts sum to {sum(send)} but the input has {a.shape[0]} rows"
    recv = None
    if recv_counts is not None and problem is None:
        recv, problem = _counts(recv_counts, size, "recv_counts")
    record = _head(
        "alltoallv",
        0,
        a,
        send if send is not None else [0] * size,
        [problem is not None, *(recv if recv is not None else [_NONE] * size)],
    )
    table = _exchange(comm, record)
    flag = 5 + size
    _raise_flagged(table, flag, "alltoallv", problem, comm.rank)
    _agree(table, 0, "the collective (alltoallv vs another v-collective)", "alltoallv")
    _agree(table, 2, "dtype", "alltoallv")
    _agree(table, 3, "the trailing dimensions of the input", "alltoallv")
    matrix = table[:, 5 : 5 + size]  # matrix[i, j]: rows rank i sends to rank j
    for r in range(size):
        wanted = table[r, flag + 1 : flag + 1 + size]
        if wanted[0] != _NONE and not np.array_equal(wanted, matrix[:, r]):
            raise MismatchError(
                f"alltoallv: rank {r} expects recv_counts {wanted.tolist()} but the ranks send it "
                f"{matrix[:, r].tolist()}"
            )
    mine = [int(n) for n in matrix[:, comm.rank]]
    out = np.empty((sum(mine),) + a.shape[1:], dtype=a.dtype)
    most = int(matrix.max()) if matrix.size else 0
    if most == 0:
        return out
    row_bytes = a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
    block = most * row_bytes
    padded = np.zeros(size * block, dtype=np.uint8)
    src, at = _bytes(a), 0
    for j, n in enumerate(send):
        padded[j * block : j * block + n * row_bytes] = src[at : at + n * row_bytes]
        at += n * row_bytes
    got = comm.alltoall(padded)
    flat, at = _bytes(out), 0
    for i, n in enumerate(mine):
        flat[at : at + n * row_bytes] = got[i * block : i * block + n * row_bytes]
        at += n * row_bytes
    return out


def allgather_object(comm, obj: Any) -> list:
    """Every rank's obj (pickled), as a list in rank order."""
    blob = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    data, sizes = _allgatherv(comm, blob, None)
    out, at = [], 0
    for n in sizes:
        out.append(pickle.loads(data[at : at + int(n)].tobytes()))
        at += int(n)
    return out


def broadcast_object(comm, obj: Any = None, root: int = 0) -> Any:
    """The root's obj (pickled) on every rank; the others' obj is ignored."""
    blob = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if comm.rank == root else None
    n = np.array([blob.size if blob is not None else 0], dtype=np.int64)
    comm.broadcast(n, root)
    data = blob.copy() if blob is not None else np.empty(int(n[0]), dtype=np.uint8)
    comm.broadcast(data, root)
    return pickle.loads(data.tobytes())


class VCollectives:
    """The calls above as methods, for Communicator and HierCommunicator alike."""

    def gather(self, x: Any, root: int = 0) -> Optional[np.ndarray]:
        return gather(self, x, root)

    def scatter(self, x: Any = None, root: int = 0) -> np.ndarray:
        return scatter(self, x, root)

    def allgatherv(self, x: Any, counts: Optional[Sequence[int]] = None) -> np.ndarray:
        return allgatherv(self, x, counts)

    def alltoallv(
        self, x: Any, send_counts: Sequence[int], recv_counts: Optional[Sequence[int]] = None
    ) -> np.ndarray:
        return alltoallv(self, x, send_counts, recv_counts)

    def allgather_object(self, obj: Any) -> list:
        return allgather_object(self, obj)

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        return broadcast_object(self, obj, root)
