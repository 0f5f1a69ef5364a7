"""Inter-host engines: the proven transports plait rides between hosts (it owns no TCP data path).

An engine group is a set of ranks, one or a few per host, that run a handful of collectives on
numpy arrays: allreduce (sum/prod/min/max), allgather, broadcast, alltoall, barrier, send/recv.
Every wait polls the engine's request with the call's deadline and checks the job's abort flag in
the rendezvous store, so a failure anywhere becomes an error here instead of a hang.

    gloo  torch.distributed's ProcessGroupGloo over a c10d store (a torch TCPStore served by rank 0,
          or the store the torch backend was handed)
    mpi   mpi4py over MPI.COMM_WORLD (plait under mpirun), sub-groups by Comm.Split

Element types an engine lacks are handled here: bool travels as uint8 (sum/max = max, prod/min =
min); for MPI, float16/bfloat16 shards are allgathered and reduced on plait's kernels
(_C.reduce_arrays) in host order, so every rank computes the same bytes.
"""

import os
import socket
import threading
import time
from datetime import timedelta

import numpy as np

from . import _C, _errors

_ABORT_CHECK_S = 0.05  # how often a wait looks at the abort flag in the store


class Abort:
    """The job-wide abort flag: a counter and a message in the rendezvous store."""

    def __init__(self, client, prefix):
        self._client, self._key = client, f"{prefix}/abort"

    def raise_if_set(self, what):
        try:
            n = self._client.add(self._key, 0)
        except _errors.PlaitError as e:
            raise _errors.PeerLostError(
                f"{what}: the rendezvous store is unreachable ({e}); the rank serving it is probably gone"
            ) from None
        if n > 0:
            try:
                msg = self._client.get(self._key + "/msg", timeout=5).decode()
            except _errors.PlaitError:
                msg = "(no message)"
            raise _errors.PeerLostError(
                f"{what}: aborted because another rank failed: {msg.partition('|')[2]}"
            )

    def origin(self):
        """(error class, message) of the first failure recorded, or None."""
        try:
            if self._client.add(self._key, 0) <= 0:
                return None
            kind, _, msg = self._client.get(self._key + "/msg", timeout=5).decode().partition("|")
        except _errors.PlaitError:
            return None
        cls = getattr(_errors, kind, _errors.PlaitError)
        return (
            cls if isinstance(cls, type) and issubclass(cls, _errors.PlaitError) else _errors.PlaitError
        ), msg

    def set(self, err, msg):
        """Records the job's first failure; later ones keep it (readers see the flag only once its
        message is there)."""
        kind = type(err).__name__ if isinstance(err, _errors.PlaitError) else "PlaitError"
        try:
            if self._client.add(self._key + "/claim", 1) == 1:
                self._client.set(self._key + "/msg", f"{kind}|{msg}".encode()[:4000])
                self._client.add(self._key, 1)
        except Exception:  # noqa: BLE001 - the store may be gone too; peers then see that
            pass


# plait's error kinds (core/errors.h ErrorKind, capi.h plait_error) as plait._errors classes
_KINDS = {1: "PlaitError", 2: "InvalidArgument", 3: "MismatchError", 4: "TimeoutError", 5: "PeerLostError"}


class _Pending:
    """An allgather started by allgather_begin; wait(deadline) finishes it or raises."""

    __slots__ = ("_g", "_w")

    def __init__(self, group, work):
        self._g, self._w = group, work

    def wait(self, deadline):
        if self._w is not None:
            self._g._wait(self._w, "allgather", deadline)


class _Group:
    """Common part: deadlines, naming, polling."""

    engine = "?"

    def __init__(self, rank, size, ranks, abort, label):
        self.rank, self.size, self.ranks = rank, size, list(ranks)  # ranks: global ranks by group rank
        self._abort, self._label = abort, label

    def _what(self, coll):
        return f"{coll} on the inter-host {self.engine} group {self._label} (global ranks {self.ranks})"

    def _poll(self, done, coll, deadline):
        # Yield (not sleep) for the first 2 ms: an inter-host step of a small message takes tens to
        # hundreds of microseconds, and MPI progresses only inside Test(). Then back off.
        start = time.monotonic()
        next_check = start + _ABORT_CHECK_S
        while not done():
            now = time.monotonic()
            if now >= deadline:
                raise _errors.TimeoutError(
                    f"{self._what(coll)}: deadline passed waiting for the other hosts' ranks"
                )
            if now >= next_check:
                self._abort.raise_if_set(self._what(coll))
                next_check = now + _ABORT_CHECK_S
            waited = now - start
            time.sleep(0 if waited < 0.002 else 0.0001 if waited < 0.05 else 0.001)

    def fail(self, kind, msg):
        """The engine's fail (csrc/hier/engine.h): sets the job-wide flag, ends this group's calls."""
        cls = getattr(_errors, _KINDS.get(int(kind), "PlaitError"))
        self._abort.set(cls(msg), msg)
        self.close(aborted=True)

    # Generic pieces every engine builds from its primitives.
    def allreduce(self, a, op, deadline, bf16=False):
        """In place on a contiguous numpy array; op in sum/prod/min/max. bf16: a holds bfloat16 bits
        (uint16)."""
        if a.size == 0 or self.size == 1:
            return a
        if a.dtype == np.bool_:
            self._allreduce(a.view(np.uint8), "max" if op in ("sum", "max") else "min", deadline, False)
        elif self.engine == "gloo" or (a.dtype.kind in "iu" or a.dtype.itemsize > 2) and not bf16:
            self._allreduce(a, op, deadline, bf16)
        else:
            parts = np.empty((self.size,) + a.shape, dtype=a.dtype)
            self.allgather(a, parts, deadline)
            # Reduced here in host order, in float32, rounded once (plait's kernels), so that every
            # rank gets the same bytes.
            _C.reduce_arrays(a, list(parts), "bfloat16" if bf16 else a.dtype.name, op)
        return a


# -- gloo ------------------------------------------------------------------------------------------
class GlooGroup(_Group):
    engine = "gloo"

    def __init__(self, c10d_store, name, rank, size, ranks, abort, timeout_s):
        super().__init__(rank, size, ranks, abort, name)
        import torch
        import torch.distributed as dist
        from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

        self._torch, self._dist = torch, dist
        opts = ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout_s)
        opts._devices = [_gloo_device(ProcessGroupGloo)]
        try:
            self._pg = ProcessGroupGloo(PrefixStore(f"plait-gloo/{name}", c10d_store), rank, size, opts)
        except RuntimeError as e:
            raise _errors.PeerLostError(
                f"creating the inter-host gloo group {name} (ranks {ranks}): {e}"
            ) from None
        self._ops = {
            "sum": dist.ReduceOp.SUM,
            "prod": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX,
        }

    def _t(self, a, bf16=False):
        t = self._torch.from_numpy(a.reshape(-1))
        return t.view(self._torch.bfloat16) if bf16 else t

    def _wait(self, work, coll, deadline, p2p=False):
        try:
            if p2p:  # gloo's send/recv works complete only inside wait(): wait on a helper thread
                done, err = threading.Event(), []
                threading.Thread(target=_wait_in_thread, args=(work, done, err), daemon=True).start()
                self._poll(done.is_set, coll, deadline)
                if err:
                    raise err[0]
                return
            self._block(work, coll, deadline)
        except RuntimeError as e:
            text = str(e)
            cls = _errors.TimeoutError if "imed out" in text or "Timeout" in text else _errors.PeerLostError
            raise cls(f"{self._what(coll)}: {text.splitlines()[0] if text else e}") from None

    def _block(self, work, coll, deadline):
        """Blocks in the work's own wait (no polling: on a busy machine a poll loop's yields cost
        more than the call), in slices of _ABORT_CHECK_S between which it looks at the abort flag
        and the deadline. A slice that ends first raises and leaves the work running."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _errors.TimeoutError(
                    f"{self._what(coll)}: deadline passed waiting for the other hosts' ranks"
                )
            try:
                work.wait(timedelta(seconds=min(left, _ABORT_CHECK_S)))
                return
            except RuntimeError:
                if work.is_completed():  # it failed, or finished as the slice ended
                    work.wait()
                    return
            self._abort.raise_if_set(self._what(coll))

    def _allreduce(self, a, op, deadline, bf16):
        o = self._dist.AllreduceOptions()
        o.reduceOp = self._ops[op]
        self._wait(self._pg.allreduce([self._t(a, bf16)], o), "allreduce", deadline)

    def allgather(self, a, out, deadline):
        """out (size * a.size elements) = every group rank's a, in group-rank order."""
        if a.size:
            self.start_allgather(a, out, deadline)()
        return out

    def start_allgather(self, a, out, deadline):
        """Starts allgather(a, out) and returns what waits for it (a and out stay untouched by the
        caller until then); the wait raises what allgather would."""
        if self.size == 1:
            out.reshape(-1)[...] = a.reshape(-1)
            return lambda: None
        work = self._pg._allgather_base(self._t(out), self._t(a))
        return lambda: self._wait(work, "allgather", deadline)

    def allgather_begin(self, a, out):
        if self.size == 1:
            out.reshape(-1)[...] = a.reshape(-1)
            return _Pending(self, None)
        return _Pending(self, self._pg._allgather_base(self._t(out), self._t(a)))

    def broadcast(self, a, root, deadline):
        if a.size == 0 or self.size == 1:
            return a
        o = self._dist.BroadcastOptions()
        o.rootRank = root
        self._wait(self._pg.broadcast([self._t(a)], o), "broadcast", deadline)
        return a

    def alltoall(self, a, out, deadline):
        if a.size == 0:
            return out
        o = self._dist.AllToAllOptions()
        self._wait(self._pg.alltoall_base(self._t(out), self._t(a), [], [], o), "alltoall", deadline)
        return out

    def barrier(self, deadline):
        if self.size > 1:
            self.allreduce(np.zeros(1, dtype=np.int32), "sum", deadline)

    def send(self, a, peer, tag, deadline):
        if a.size:
            self._wait(self._pg.send([self._t(a)], peer, tag), "send", deadline, p2p=True)

    def recv(self, a, peer, tag, deadline):
        if a.size:
            self._wait(self._pg.recv([self._t(a)], peer, tag), "recv", deadline, p2p=True)

    def close(self, aborted=False):
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and aborted:
            try:
                pg.abort()  # closes the pairs: an op blocked on a live but failed peer ends now
            except Exception:  # noqa: BLE001
                pass


def _wait_in_thread(work, done, err):
    try:
        work.wait()
    except BaseException as e:  # noqa: BLE001 - handed to the polling thread
        err.append(e)
    done.set()


def _gloo_device(pgg):
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        return pgg.create_device(interface=ifname.split(",")[0])
    host = os.environ.get("PLAIT_GLOO_HOST")
    if host:
        return pgg.create_device(hostname=host)
    return pgg.create_default_device()


def c10d_store_for(client, rank, prefix, timeout_s):
    """A torch TCPStore for the gloo groups: served by global rank 0, its address published in
    plait's store. The address is the one rank 0's own connection to plait's store came from,
    which the other hosts can therefore reach (MASTER_ADDR when plait's store is not a socket)."""
    from torch._C._distributed_c10d import TCPStore

    key = f"{prefix}/gloo-store"
    to = timedelta(seconds=timeout_s)
    if rank == 0:
        sock = getattr(client, "_sock", None)
        host = sock.getsockname()[0] if sock is not None else os.environ.get("MASTER_ADDR", "127.0.0.1")
        st = TCPStore(
            host if host not in ("0.0.0.0", "::") else "127.0.0.1", 0, None, True, to, wait_for_workers=False
        )
        client.set(key, f"{host}:{st.port}".encode())
        return st
    host, _, port = client.get(key, timeout=timeout_s).decode().rpartition(":")
    return TCPStore(host, int(port), None, False, to, wait_for_workers=False)


# -- mpi -------------------------------------------------------------------------------------------
class MpiGroup(_Group):
    engine = "mpi"

    def __init__(self, comm, ranks, abort, label):
        super().__init__(comm.Get_rank(), comm.Get_size(), ranks, abort, label)
        from mpi4py import MPI

        self._c, self._MPI = comm, MPI
        self._ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def _wait(self, req, coll, deadline):
        try:
            self._poll(req.Test, coll, deadline)
        except BaseException:
            try:
                req.Cancel()
            except Exception:  # noqa: BLE001 - collectives cannot be cancelled; the job is aborting
                pass
            raise

    def _allreduce(self, a, op, deadline, bf16):
        self._wait(self._c.Iallreduce(self._MPI.IN_PLACE, _buf(a), self._ops[op]), "allreduce", deadline)

    def allgather(self, a, out, deadline):
        if a.size:
            self.start_allgather(a, out, deadline)()
        return out

    def start_allgather(self, a, out, deadline):
        req = self._c.Iallgather(_buf(a), _buf(out))
        return lambda: self._wait(req, "allgather", deadline)

    def allgather_begin(self, a, out):
        return _Pending(self, self._c.Iallgather(_buf(a), _buf(out)))

    def broadcast(self, a, root, deadline):
        if a.size:
            self._wait(self._c.Ibcast(_buf(a), root), "broadcast", deadline)
        return a

    def alltoall(self, a, out, deadline):
        if a.size:
            self._wait(self._c.Ialltoall(_buf(a), _buf(out)), "alltoall", deadline)
        return out

    def barrier(self, deadline):
        self._wait(self._c.Ibarrier(), "barrier", deadline)

    def send(self, a, peer, tag, deadline):
        self._wait(self._c.Isend(_buf(a), peer, tag), "send", deadline)

    def recv(self, a, peer, tag, deadline):
        self._wait(self._c.Irecv(_buf(a), peer, tag), "recv", deadline)

    def close(self, aborted=False):
        c, self._c = getattr(self, "_c", None), None
        if c is not None and not aborted:
            try:
                c.Free()
            except Exception:  # noqa: BLE001
                pass


def _buf(a):
    """A buffer MPI understands: half types travel as raw bytes (only moved, never reduced by MPI)."""
    a = a.reshape(-1)
    if a.dtype.kind == "f" and a.dtype.itemsize == 2:
        return a.view(np.uint16)
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    return a


# -- creation --------------------------------------------------------------------------------------
def groups(engine, client, prefix, rank, size, lay, ctx, timeout, init_timeout):
    """(inter group or None, world group, c10d store or None) of this rank for a layout
    (plait._hosts.Layout): the shard group of its local rank (uniform layout) or the leaders'."""
    if lay.uniform:
        inter_ranks = [m[lay.i] for m in lay.hosts]
        inter_name, inter_rank = f"shard{lay.i}", lay.h
    else:
        inter_ranks = [m[0] for m in lay.hosts]
        inter_name, inter_rank = "leaders", lay.h if lay.i == 0 else None
    abort = Abort(client, prefix)
    if engine == "gloo":
        store = ctx.get("torch_store")
        if store is None:
            store = ctx.get("c10d_store") or c10d_store_for(client, rank, prefix, init_timeout)
            ctx["c10d_store"] = store
        from torch._C._distributed_c10d import PrefixStore

        store = PrefixStore(prefix, store)
        world = GlooGroup(store, "world", rank, size, range(size), abort, timeout)
        inter = (
            None
            if inter_rank is None
            else GlooGroup(store, inter_name, inter_rank, len(inter_ranks), inter_ranks, abort, timeout)
        )
        return inter, world, store
    from mpi4py import MPI

    wcomm = ctx.get("mpi_world") or MPI.COMM_WORLD
    if wcomm.Get_size() != size or wcomm.Get_rank() != rank:
        raise _errors.InvalidArgument(
            f"rank {rank}: the MPI engine needs plait's ranks to be MPI's (MPI rank "
            f"{wcomm.Get_rank()} of {wcomm.Get_size()}, plait rank {rank} of {size}); "
            f"set PLAIT_INTER=gloo or leave RANK/WORLD_SIZE to mpirun"
        )
    ctx["mpi_world"] = wcomm
    world = MpiGroup(wcomm.Dup(), range(size), abort, "world")
    sub = wcomm.Split(lay.i if lay.uniform else (0 if lay.i == 0 else MPI.UNDEFINED), lay.h)
    inter = None if sub == MPI.COMM_NULL else MpiGroup(sub, inter_ranks, abort, inter_name)
    return inter, world, None


# -- choice ----------------------------------------------------------------------------------------
_INSTALL = (
    "install an inter-host engine: `pip install torch` (gloo), or `apt-get install openmpi-bin "
    "libopenmpi-dev && pip install mpi4py` and run under mpirun"
)


def _have(mod):
    import importlib.util

    return importlib.util.find_spec(mod) is not None


def choose(torch_store=None):
    """'gloo' or 'mpi' (PLAIT_INTER overrides) or None when neither is usable here."""
    want = os.environ.get("PLAIT_INTER", "").strip().lower()
    mpi_ok = "OMPI_COMM_WORLD_SIZE" in os.environ and _have("mpi4py")
    gloo_ok = _have("torch")
    if want:
        if want not in ("gloo", "mpi"):
            raise _errors.InvalidArgument(f"PLAIT_INTER={want!r}: choose gloo or mpi")
        if want == "mpi" and not mpi_ok:
            raise _errors.InvalidArgument(
                "PLAIT_INTER=mpi needs mpi4py and a job started by mpirun "
                "(OMPI_COMM_WORLD_SIZE is not set or mpi4py is missing)"
            )
        if want == "gloo" and not gloo_ok:
            raise _errors.InvalidArgument("PLAIT_INTER=gloo needs torch (pip install torch)")
        return want
    if torch_store is not None:
        return "gloo"
    return "mpi" if mpi_ok else "gloo" if gloo_ok else None


def no_engine_error(rank, hosts):
    return _errors.InvalidArgument(
        f"rank {rank}: the ranks span {hosts} hosts but no inter-host engine is available: {_INSTALL}"
    )


def hostname():
    return socket.gethostname()
