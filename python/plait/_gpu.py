"""GPU arrays on a Communicator: the Python-side checks, the GPU queue created by the first GPU
call, and the call itself.

A GPU call takes the communicator's own call path (csrc/core/communicator.cc: validate -> select
-> check -> run); only the run differs: the communicator's GPU queue enqueues it on the caller's
stream, through the transport that connects the ranks (cuda/stream_queue.h). Every rank creates
that queue inside the same (first) GPU collective. The ranks first agree over the communicator
(its deadline and abort) on which GPU each uses and whether each loaded NCCL; the ordered
transport table then picks the transport. With one GPU per rank it is NCCL: rank 0's unique id is
broadcast over the communicator. When ranks share a GPU (NCCL refuses that), or
PLAIT_GPU_TRANSPORT=ipc, it is CUDA IPC: the ranks exchange cudaIpc handles of their staging the
same way. Input a rank rejects aborts the call on every rank through the communicator
(`comm.fail`), as on the host path.

A HierCommunicator (ranks on several hosts) gets one flat NCCL queue of all its ranks, standing
alone: NCCL does its own steps inside and between hosts. The ranks agree and exchange the unique
id over the HierCommunicator, and compare each call with one small allreduce (no segment reaches
every host); the queue's abort coupling is the host-local communicator (other hosts learn of an
error through NCCL's errors and the call's deadline). The CUDA IPC transport reaches one host
only, so it is refused there.
"""

import atexit
import os
import weakref
import zlib

import numpy as np

from . import _C, _arrays, _cuda, _errors

DEFAULT_CHUNK_BYTES = 4 << 20  # PLAIT_GPU_CHUNK_BYTES; a guess until measured on a GPU
_ITEMSIZE = _arrays.ITEMSIZE
DEFAULT_IPC_BYTES = 8 << 20  # PLAIT_GPU_IPC_BYTES: staging per rank of the IPC transport; a guess too
_CODES = dict(_C.COLLECTIVES)  # the core's codes, never numbered here
_OP_CODES = dict(_C.OPS)


class GpuHandle:
    """A GPU call in flight: completes when the work enqueued on its stream has run."""

    __slots__ = ("_event", "_keep", "_result", "device")

    def __init__(self, event, keep, result, device=None):
        self._event, self._keep, self._result, self.device = event, keep, result, device

    def wait(self, timeout=None):
        """Blocks the host until the call's GPU work is done; raises its error.

        `timeout` bounds only this wait; the call's own deadline aborts it with TimeoutError.
        """
        wait_s = (
            -1.0
            if timeout is None
            else _errors.seconds(
                timeout, "Handle.wait: timeout", "only look whether the call is done; None waits for it"
            )
        )
        if not self._event.wait(wait_s):
            raise _errors.TimeoutError(f"the GPU call is still running after {timeout} s of waiting")
        self._keep = None
        return self._result

    def done(self):
        return self._event.done()

    def block(self, stream):
        """Makes CUDA `stream` (a cudaStream_t as an int) wait for the call and returns at once, as
        torch's NCCL Work.wait() does; raises an error already recorded. The communicator's
        watchdog enforces the call's deadline (its error is raised by the next call)."""
        self._event.block(int(stream))


def wants_gpu(x, out):
    return (x is not None and type(x) is not np.ndarray and _arrays.is_gpu(x)) or (
        out is not None and type(out) is not np.ndarray and _arrays.is_gpu(out)
    )


def _array(comm, obj, name, coll):
    if obj is None or not _arrays.is_gpu(obj):
        return None
    try:
        return _arrays.gpu_array(obj, name, _C.cuda_pointer_device)
    except _errors.InvalidArgument as e:
        comm.fail(f"rank {comm.rank}: {coll}: {e}")


def _hierarchical(comm):
    return getattr(comm, "layout", None) is not None


def _transport(comm, head):
    transport = os.environ.get("PLAIT_GPU_TRANSPORT", "auto")
    if transport not in ("auto", "nccl", "ipc"):
        comm.fail(f"{head}: PLAIT_GPU_TRANSPORT={transport!r} (auto, nccl or ipc)")
    if transport == "ipc" and _hierarchical(comm):
        comm.fail(
            f"{head}: PLAIT_GPU_TRANSPORT=ipc, but this communicator's ranks span "
            f"{comm.layout.nhosts} hosts and the CUDA IPC transport reaches one host only; "
            f"unset it (or set nccl): NCCL runs GPU collectives across hosts"
        )
    return transport


def check_usable(comm, coll, what):
    """Fails the call on every rank when this build or process cannot run GPU work."""
    head = f"rank {comm.rank}: {coll} ({what})"
    if coll not in _cuda.GPU_COLLECTIVES:
        comm.fail(
            f"{head}: GPU arrays are taken by {', '.join(_cuda.GPU_COLLECTIVES)} only in this "
            f"version; pass host arrays"
        )
    if _hierarchical(comm):
        _transport(comm, head)  # a setting no rank can run is refused before any device check
    if not _cuda.compiled():
        comm.fail(
            f"{head}: this plait build has no CUDA path (plait.build_info()['cuda'] is False); "
            f"rebuild with nvcc on PATH and PLAIT_CUDA=ON"
        )
    if _cuda.device_count() == 0:
        comm.fail(
            f"{head}: no CUDA device is visible to this process (plait.build_info()['cuda_devices'] == 0)"
        )


def check_input(comm, coll, x):
    """The checks that come before allocating a default output like a GPU input."""
    gx = _array(comm, x, "input", coll)
    check_usable(comm, coll, gx.describe())


_FIELDS = ("GPU call number", "collective", "count", "dtype", "op", "root", "algorithm")


def _check_calls(comm, g, head, coll, dt, count, op, root, algorithm, timeout):
    """A multi-host job's GPU calls are compared across ranks like host calls (NCCL would hang or
    mix data on a mismatch). On one host the communicator's call path compares them through the
    shared segment without waiting for anyone (csrc/core/call_check.cc); across hosts no segment
    reaches every rank, so the check is one tiny max-allreduce of the call's fields and their
    negatives over the HierCommunicator. Ranks that disagree raise MismatchError."""
    root = int(root) if coll in ("broadcast", "reduce") else 0
    # The algorithm that will run, not the one asked for: "auto" and its name agree, and a
    # PLAIT_GPU_ALGO that differs between ranks is caught here instead of hanging.
    try:
        algorithm = g.resolve(coll, algorithm)
    except _errors.InvalidArgument as e:
        comm.fail(f"{head}: {e}")
    seq = getattr(comm, "_gpu_calls", 0) + 1
    comm._gpu_calls = seq
    codes = (
        seq,
        _CODES.get(coll, 99),
        int(count),
        sorted(_ITEMSIZE).index(dt),
        _OP_CODES.get(op, -1),
        root,
        zlib.crc32((algorithm or "auto").encode()),
    )
    v = np.array(codes + tuple(-c for c in codes), dtype=np.int64)
    comm.allreduce(v, v, op="max", timeout=timeout)
    k = len(codes)
    hi, lo = v[:k], -v[k:]
    if (hi == lo).all():
        return
    diff = ", ".join(f"{f} ({lo[j]}..{hi[j]})" for j, f in enumerate(_FIELDS) if hi[j] != lo[j])
    msg = (
        f"{head}: mismatched GPU calls: ranks disagree on {diff} (this rank: {coll} #{seq}, "
        f"count={count}, dtype={dt}, op={op}, algorithm={algorithm})"
    )
    comm.fail(msg, "mismatch")  # aborts the communicator on every rank and raises


def call(comm, coll, x, out, op, algorithm, timeout, async_op, dtype, result, root=0, peer=-1, tag=0):
    gx, go = _array(comm, x, "input", coll), _array(comm, out, "output", coll)
    fail = comm.fail
    head = f"rank {comm.rank}: {coll} ({(gx or go).describe()})"
    # reduce has no output on a non-root, send none, recv no input (all None by then).
    if (
        (gx is None and x is not None)
        or (go is None and out is not None)
        or (x is None and coll != "recv")
        or (out is None and coll not in ("send", "reduce"))
    ):
        host, obj = ("input", x) if gx is None else ("output", out)
        fail(
            f"{head}: the {host} is a host array ({type(obj).__name__}) and the other a GPU array; "
            f"pass both on the same GPU"
        )
    ga = gx or go
    check_usable(comm, coll, ga.describe())
    if gx is not None and go is not None and gx.device != go.device:
        fail(f"{head}: input on GPU {gx.device}, output on GPU {go.device}; pass both on the same GPU")
    dt = dtype or ga.dtype
    if dtype is None and gx is not None and go is not None and go.dtype != gx.dtype:
        fail(f"{head}: input is {gx.dtype}, output is {go.dtype}")
    if dt not in _ITEMSIZE:
        fail(
            f"{head}: unsupported dtype {dt} "
            "(float16, bfloat16, float32, float64, int8, uint8, int32, int64, bool)"
        )
    if any(a is not None and a.itemsize != _ITEMSIZE[dt] for a in (gx, go)):
        fail(
            f"{head}: dtype={dt!r} needs {_ITEMSIZE[dt]}-byte elements, the arrays have "
            f"{' and '.join(str(a.itemsize) for a in (gx, go) if a is not None)}"
        )
    if coll in ("send", "recv"):
        if tag != 0:
            fail(
                f"{head}: tag {tag}: GPU send/recv run over NCCL, which has no tags; they match in issue "
                f"order per pair of ranks (pass tag=0)"
            )
        if comm._gpu is None and comm.size > 2:
            # Creating the GPU communicator is a collective: two ranks of a larger world cannot.
            raise _errors.InvalidArgument(
                f"{head}: the first GPU call of a communicator of {comm.size} ranks must be a collective "
                f"(it creates the GPU communicator on every rank); make one, e.g. a broadcast of a GPU "
                f"array, before GPU send/recv"
            )
    if timeout is not None:  # the GPU communicators take any value < 0 as "the default"
        try:
            timeout = _errors.seconds(timeout, "timeout", "fail at once if a peer is not there")
        except _errors.InvalidArgument as e:
            fail(f"{head}: {e}")
    g = _communicator(comm, ga.device, timeout, head)
    t = -1.0 if timeout is None else float(timeout)  # < 0: the queue's deadline
    algo = algorithm or "auto"
    # gx, go: plait._arrays.GpuArray (pointer, bytes, dtype, device and the owner keeping it alive)
    if _hierarchical(comm):
        if coll not in ("send", "recv"):
            _check_calls(comm, g, head, coll, dt, ga.nbytes // _ITEMSIZE[dt], op, root, algo, timeout)
        g.call(coll, gx, go, dt, op, algo, ga.stream, t, root, peer)
    else:
        # The communicator's own call path: validate -> select -> check -> enqueue on g.
        _C.gpu_call(comm._c, coll, gx, go, dt, op, algo, ga.stream, t, root, peer)
    # Sync and async alike, on the default stream too: an async handle dropped after block()
    # holds no reference either.
    _record_streams(gx, go)
    if async_op:
        return GpuHandle(g.record(ga.stream, t), (x, out), result, ga.device)
    return result


def _record_streams(*arrays):
    """Tells torch's caching allocator that the call's tensors are in use on the call's stream
    (as ProcessGroupNCCL does), so a tensor freed right after the call is not handed out again
    on another stream before the collective ran. Always: a tensor allocated on a side stream and
    used on the default stream needs it as much as the reverse, and torch makes it a no-op when
    the streams are the same."""
    for a in arrays:
        if a is not None:
            a.record_stream()


def _communicator(comm, device, timeout, head):
    g = comm._gpu
    if g is not None:
        if g.device != device:
            comm.fail(
                f"{head}: this communicator's GPU work runs on GPU {g.device}; every GPU array "
                f"of a rank must be on one GPU"
            )
        return g
    t = comm.timeout if timeout is None else float(timeout)
    transport = _transport(comm, head)
    hier = _hierarchical(comm)
    err = ""
    try:
        uuid = _C.cuda_device_uuid(device)
    except _errors.PlaitError as e:
        comm.fail(f"{head}: {e}")
    try:
        _cuda.load_nccl()
    except _errors.PlaitError as e:
        err = str(e)
    mine = np.zeros(24, dtype=np.uint8)
    mine[0] = 0 if err else 1
    mine[8:24] = np.frombuffer(uuid, dtype=np.uint8)
    table = comm.allgather(mine, timeout=t)
    seen, shared = {}, None
    for r in range(comm.size):
        key = bytes(table[r][8:24])
        if key in seen and shared is None:
            shared = (seen[key], r, key.hex())
        seen.setdefault(key, r)
    bad = [r for r in range(comm.size) if not table[r][0]]
    # The first transport of the ordered table that can connect these ranks' GPU buffers.
    chosen = _C.select_transport(
        device_buffers=True,
        one_host=not hier,
        shared_gpu=shared is not None,
        nccl_loaded=not bad,
        prefer=transport,
    )
    if chosen == "ipc":
        g = _ipc_queue(comm, device, t, head)
    else:  # nccl, or none: say why NCCL cannot connect them
        if shared is not None and hier:
            raise _errors.InvalidArgument(
                f"{head}: ranks {shared[0]} and {shared[1]} use the same GPU (uuid {shared[2]}); across "
                f"hosts GPU collectives run over NCCL, which refuses two ranks on one GPU: give each "
                f"rank its own GPU"
            )
        if shared is not None:
            raise _errors.InvalidArgument(
                f"{head}: ranks {shared[0]} and {shared[1]} use the same GPU (uuid {shared[2]}) and "
                f"PLAIT_GPU_TRANSPORT=nccl; NCCL refuses two ranks on one GPU (use the IPC transport: "
                f"PLAIT_GPU_TRANSPORT=auto or ipc)"
            )
        if bad:
            raise _errors.PlaitError(
                f"{head}: rank(s) {bad} could not load NCCL"
                + (f": {err}" if err else " (their own errors say why)")
            )
        if chosen != "nccl":
            raise _errors.PlaitError(f"{head}: no transport of this build connects these ranks' GPU arrays")
        g = _nccl_queue(comm, device, t, head)
    _C.gpu_attach(comm._c, g)  # the communicator (flat or C++ multi-host) enqueues its GPU calls there
    comm._gpu = g
    _LIVE.add(comm)
    return g


_LIVE = weakref.WeakSet()  # communicators that have a GPU queue


@atexit.register
def _finalize_at_exit():
    """A script that ends with GPU calls in flight and no finalize(): finalize its queues while
    the CUDA runtime is still loaded, so their watchdogs stop polling events before it unloads
    (cudaErrorCudartUnloading would read as a GPU failure and abort every rank; review 2,
    finding 14). A queue that already failed returns at once; errors are of no use here."""
    for comm in list(_LIVE):
        g = getattr(comm, "_gpu", None)
        if g is not None:
            try:
                g.finalize()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass


def _chunk_bytes(comm, head):
    v = os.environ.get("PLAIT_GPU_CHUNK_BYTES", "")
    try:
        chunk = int(v) if v else DEFAULT_CHUNK_BYTES
    except ValueError:
        chunk = -1
    if chunk < 64:
        comm.fail(f"{head}: PLAIT_GPU_CHUNK_BYTES={v!r}: need a whole number of bytes >= 64")
    return chunk


def _nccl_queue(comm, device, t, head):
    chunk = _chunk_bytes(comm, head)  # before the unique id: peers learn of it at once
    uid = np.zeros(128, dtype=np.uint8)
    if comm.rank == 0:
        try:
            uid[:] = np.frombuffer(_C.nccl_unique_id(_cuda.nccl_path()), dtype=np.uint8)
        except _errors.PlaitError as e:
            comm.fail(f"{head}: ncclGetUniqueId: {e}")
    comm.broadcast(uid, 0, timeout=t)
    # Every rank is inside ncclCommInitRankConfig until all have joined: a rank that fails before
    # it joins (loading NCCL, scratch memory, a bad setting) tells the others through the
    # communicator, or they would wait out their whole deadline and report it as a timeout.
    try:
        if _hierarchical(comm):
            return _C.nccl_queue(
                comm.local._c,
                uid.tobytes(),
                device,
                t,
                chunk,
                os.environ.get("PLAIT_GPU_ALGO", ""),
                _cuda.nccl_path(),
                rank=comm.rank,
                size=comm.size,
            )
        return _C.nccl_queue(
            comm._c, uid.tobytes(), device, t, chunk, os.environ.get("PLAIT_GPU_ALGO", ""), _cuda.nccl_path()
        )
    except _errors.PlaitError as e:
        comm.fail(f"{head}: creating the NCCL communicator: {e}")


def after_finalize(comm, g):
    """Called by Communicator.finalize once its GPU queue finalized. Over CUDA IPC a peer's final
    drain still reads this rank's flags after this rank's own drain ended, so no rank frees its
    IPC memory (when `g` is dropped) before every rank finished: a host barrier, skipped when the
    communicator already failed (then nobody drains, and the barrier would only raise)."""
    if g.transport != "ipc":
        return
    try:
        comm.barrier()
    except _errors.PlaitError:
        pass


def _ipc_queue(comm, device, t, head):
    staging = int(os.environ.get("PLAIT_GPU_IPC_BYTES", DEFAULT_IPC_BYTES))
    try:
        g = _C.ipc_queue(comm._c, device, t, staging)
        mine = np.frombuffer(g.handle(), dtype=np.uint8)
    except _errors.PlaitError as e:
        comm.fail(f"{head}: setting up the CUDA IPC transport: {e}")
    handles = comm.allgather(mine, timeout=t)
    try:
        g.open([bytes(handles[r]) for r in range(comm.size)])
    except _errors.PlaitError as e:
        comm.fail(f"{head}: opening the peers' CUDA IPC handles: {e}")
    comm.barrier(timeout=t)  # every rank mapped every region before anyone posts into them
    return g
