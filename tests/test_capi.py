"""plait's C API (csrc/bindings/capi.h), driven from ctypes as a native module drives it: the table
is the one door into a communicator (core/comm.h), for host buffers and for device buffers, which
it routes to the communicator's GPU path."""

import ctypes

import numpy as np
import pytest

from conftest import run_ranks
from plait import _C, _cuda

HOST, CUDA = 0, 1
ALLREDUCE, BROADCAST = _C.COLLECTIVES["allreduce"], _C.COLLECTIVES["broadcast"]
F32, I64 = 2, 7  # plait::DType codes (capi.h's plait_dtype)
E_INVALID = 2


class Buf(ctypes.Structure):
    _fields_ = [
        ("ptr", ctypes.c_void_p),
        ("bytes", ctypes.c_size_t),
        ("dtype", ctypes.c_uint8),
        ("present", ctypes.c_uint8),
        ("writable", ctypes.c_uint8),
        ("device", ctypes.c_uint8),
        ("device_index", ctypes.c_int32),
        ("stream", ctypes.c_size_t),
    ]


_CALL = ctypes.CFUNCTYPE(
    ctypes.c_uint32,
    ctypes.c_void_p,
    ctypes.c_uint8,
    ctypes.POINTER(Buf),
    ctypes.POINTER(Buf),
    ctypes.c_uint8,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
    ctypes.c_char_p,
    ctypes.c_double,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_char_p,
    ctypes.c_size_t,
)
_INT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class Table(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint32),
        ("struct_size", ctypes.c_uint32),
        ("rank", _INT),
        ("size", _INT),
        ("call", _CALL),
        ("fail", ctypes.c_void_p),
        ("task_run", ctypes.c_void_p),
        ("task_release", ctypes.c_void_p),
        ("finalize", ctypes.c_void_p),
        ("task_peer", ctypes.c_void_p),
        ("shared_alloc", ctypes.c_void_p),
        ("shared_free", ctypes.c_void_p),
        ("task_start", ctypes.c_void_p),
    ]


def _pointer(capsule, name):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, name)


def _table():
    return Table.from_address(_pointer(_C._capi, b"plait._C._capi"))


def _host(a):
    return Buf(a.ctypes.data, a.nbytes, F32 if a.dtype == np.float32 else I64, 1, 1, HOST, -1, 0)


def _call(t, comm, coll, x, y, root=0):
    err = ctypes.create_string_buffer(512)
    kind = t.call(
        comm, coll, ctypes.byref(x), ctypes.byref(y), 0, root, -1, 0, b"", -1.0, None, None, None, err, 512
    )
    return kind, err.value.decode()


def test_table_version_and_layout():
    t = _table()
    assert t.version == 3 and t.struct_size == ctypes.sizeof(Table)


def _host_calls(rank, n, addr):
    import plait

    comm = plait.init(rank, n, store=addr, timeout=30)
    t = _table()
    c = _pointer(_C._comm_capsule(comm._c), b"plait.Communicator")
    assert (t.rank(c), t.size(c)) == (rank, n)
    x = np.arange(10, dtype=np.float32) * (rank + 1)
    y = np.empty_like(x)
    got = [_call(t, c, ALLREDUCE, _host(x), _host(y))]
    b = np.full(3, rank, dtype=np.int64)
    got.append(_call(t, c, BROADCAST, _host(b), _host(b), root=n - 1))
    comm.finalize()
    return got, y.tolist(), b.tolist()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_host_buffers_through_the_c_api(n):
    tri = n * (n + 1) // 2
    for got, y, b in run_ranks(_host_calls, n, timeout=60):
        assert got == [(0, ""), (0, "")]
        assert y == [float(tri * k) for k in range(10)]
        assert b == [n - 1] * 3


def _device_calls(rank, n, addr, fake):
    import plait

    comm = plait.init(rank, n, store=addr, timeout=30)
    q = None
    if fake:  # the recording queue a CUDA build's first GPU call would attach as the real one
        q = _C._FakeGpuQueue(comm._c, 0, "nccl", 30.0, "")
        _C.gpu_attach(comm._c, q)
    t = _table()
    c = _pointer(_C._comm_capsule(comm._c), b"plait.Communicator")
    stream = 0x5000 + rank
    x = Buf(1 << 20, 64, F32, 1, 1, CUDA, 0, stream)
    y = Buf(2 << 20, 64, F32, 1, 1, CUDA, 0, stream)
    got = _call(t, c, ALLREDUCE, x, y)
    records = q.records() if q is not None else []
    try:
        comm.finalize()
    except plait.PlaitError:
        pass
    return got, records


def test_device_buffers_reach_the_gpu_path_on_every_rank():
    # No GPU queue attached: the call reaches the GPU path, which refuses it on every rank (a host
    # buffer of these sizes would have been read at those made-up addresses).
    for kind, msg in (r[0] for r in run_ranks(_device_calls, 2, timeout=60, args=(False,))):
        assert kind == E_INVALID and "GPU arrays need this communicator's GPU transport" in msg, msg
        assert "allreduce" in msg


@pytest.mark.skipif(not _cuda.compiled(), reason="the GPU algorithm rows are compiled into CUDA builds only")
def test_device_buffers_are_enqueued_on_their_stream():
    for rank, (got, records) in enumerate(run_ranks(_device_calls, 2, timeout=60, args=(True,))):
        assert got == (0, "")
        assert [(r[0], r[2], r[3]) for r in records] == [("allreduce", 16, 0x5000 + rank)]


def _bad_code(rank, n, addr):
    import time

    import plait

    comm = plait.init(rank, n, store=addr, timeout=30)
    t = _table()
    c = _pointer(_C._comm_capsule(comm._c), b"plait.Communicator")
    x = np.arange(4, dtype=np.float32)
    y = np.empty_like(x)
    bx, by = _host(x), _host(y)
    if rank == 0:
        bx.dtype = by.dtype = 99  # no such dtype: refused before any communication
    t0 = time.monotonic()
    got = _call(t, c, ALLREDUCE, bx, by)
    took = time.monotonic() - t0
    try:
        comm.finalize()
    except plait.PlaitError:
        pass
    return got, took


def test_bad_code_through_the_c_api_fails_every_rank():
    for rank, ((kind, msg), took) in enumerate(run_ranks(_bad_code, 3, timeout=60)):
        assert kind == E_INVALID and "rank 0: C API call: bad collective (0), dtype or device code" in msg, (
            rank,
            msg,
        )
        assert took < 10, (rank, took)  # the peers learn of it at once, not at their 30 s deadline
