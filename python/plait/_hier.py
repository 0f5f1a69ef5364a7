"""Hierarchical communicator: plait's shared memory inside each host, an inter-host engine between.

At init every rank publishes its host identity (PLAIT_HOST_ID, else hostname + boot id) in the
rendezvous store. One host: plait.init returns the flat Communicator, unchanged. Several hosts:
it returns a HierCommunicator, whose calls run in C++ (csrc/hier/hier_comm.h: the layout, the
steps, the cross-host check, the errors), built here from

    local   a plait shared-memory Communicator of the ranks of this host (local rank = order by
            global rank)
    inter   uniform layout (every host has L ranks): the shard group of local rank i, i.e. local
            rank i of every host, H ranks ordered by host. Otherwise: the leaders (local rank 0).
    world   an engine group of all ranks, for alltoall and send/recv between hosts.

This module chooses the engine and creates its groups: the native engines when they are
importable (gloo inside the native torch module, MPI in plait._mpi), else plait._inter's groups
wrapped as engines by _C._py_engine. Each call is one task on the local communicator's progress
thread; async calls return the same Handle as the flat communicator's.

GPU arrays skip all of this: they go to one flat NCCL communicator of all ranks (plait._gpu), which
does its own steps inside and between hosts.
"""

from __future__ import annotations

import sys

import numpy as np

from . import _C, _comm, _errors, _inter
from ._hosts import Layout

_FRAME = _C.HIER_FRAME  # bytes of every rank's first message of a call on an engine group
_ROOM = _C.HIER_ROOM  # engine payloads up to this size travel in that frame itself


class HierCommunicator(_comm.Communicator):
    """Same methods and semantics as plait.Communicator, for ranks that span hosts."""

    def __init__(self, native, layout, local, engine, *, timeout, ctx, keep):
        super().__init__(
            native,
            timeout=float(timeout),
            buffer_bytes=ctx.get("buffer_bytes"),
            world_size=native.size,
            keep=keep,
        )
        self.layout, self.local, self.engine = layout, local, engine
        self._ctx = ctx
        self._nsplit = 0

    def __repr__(self):
        return (
            f"<plait.HierCommunicator rank {self.rank} of {self.size}, host {self.layout.h} of "
            f"{self.layout.nhosts}, {self.engine} between hosts{' (finalized)' if self.closed else ''}>"
        )

    # The shared-memory properties are the host's communicator's.
    @property
    def single_copy(self) -> bool:
        return self.local.single_copy

    @property
    def single_copy_unavailable(self) -> str:
        return self.local.single_copy_unavailable

    @property
    def mapped_bytes(self) -> int:
        return self.local.mapped_bytes

    # -- groups and lifetime -------------------------------------------------------------------
    def split(
        self, color: int | None, key: int = 0, *, buffer_bytes: int | None = None
    ) -> _comm.Communicator | None:
        """MPI_Comm_split over the hosts: the new communicator is flat when its ranks share a host."""
        if self.closed:
            raise _errors.PlaitError("communicator is finalized; split needs a live one")
        c = -1 if color is None or color < 0 else int(color)
        table = self.allgather(np.array([c, int(key), self.rank], dtype=np.int64))
        members = sorted((int(k), int(r)) for cc, k, r in table if cc == c) if c >= 0 else []
        n = self._nsplit
        self._nsplit += 1
        ctx = dict(self._ctx)
        if self.engine == "mpi":
            from mpi4py import MPI

            ctx["mpi_world"] = self._ctx["mpi_world"].Split(c if c >= 0 else MPI.UNDEFINED, int(key))
        if c < 0:
            return None
        new_rank = [r for _, r in members].index(self.rank)
        return ctx["init_in"](  # _bootstrap.init_in, handed in by create: no import back up
            ctx["client"],
            f"{ctx['prefix']}/split{n}/{c}",
            new_rank,
            len(members),
            timeout=self.timeout,
            init_timeout=max(self.timeout, 60.0),
            buffer_bytes=buffer_bytes or ctx.get("buffer_bytes"),
            keep=[],
            ctx=ctx,
        )

    def finalize(self) -> None:
        super().finalize()  # the GPU queue, then the native communicator (and its engines)
        self.local.finalize()

    close = finalize


_warned = set()


def _gloo_module():
    """The native torch module (compiled at its first use, as for `import plait.torch`), or None
    where it cannot be built: the multi-host communicator then drives gloo through _inter's Python
    group (_C._py_engine), said once on stderr."""
    mod = getattr(sys.modules.get("plait.torch._native"), "_module", None)
    if mod is not None:
        return mod
    try:
        from .torch import _native  # noqa: PLC0415 - torch is there: gloo is torch's

        return _native.load()
    except ImportError as e:  # NativeBuildError is one
        if "gloo" not in _warned:
            _warned.add("gloo")
            print(f"plait: no native gloo engine ({e}); using the Python one", file=sys.stderr)
        return None


def _native_engine(engine, group, store, label):
    """The native engine's capsule for an _inter group, or None where it is not built: gloo in the
    native torch module, MPI in plait._mpi."""
    try:
        if engine == "gloo":
            make = getattr(_gloo_module(), "make_gloo_engine", None)
            return None if make is None else make(group._pg, store, label)
        from . import _mpi  # noqa: PLC0415 - optional extension, built where CMake finds MPI

        return _mpi.make_engine(group._c, label)
    except ImportError:
        return None


def _engine(engine, group, store, label):
    """An engine capsule for _C.HierComm (which owns it), None for no group."""
    if group is None:
        return None
    cap = _native_engine(engine, group, store, label)
    return cap if cap is not None else _C._py_engine(group)


def create(client, prefix, rank, size, ids, *, timeout, init_timeout, buffer_bytes, keep, ctx, join_local):
    """The HierCommunicator of this rank. ids: every rank's (host id, machine id). ctx["init_in"]
    is the rendezvous (_bootstrap.init_in) that split joins its new communicators through."""
    lay = Layout([h for h, _ in ids], rank)
    ctx = dict(ctx or {})
    torch_store = ctx.get("torch_store")
    if torch_store is None and hasattr(client, "_torch"):
        torch_store = client._torch
        ctx["torch_store"] = torch_store
    engine = ctx.get("engine") or _inter.choose(torch_store)
    if engine is None:
        raise _inter.no_engine_error(rank, lay.nhosts)
    ctx.update(engine=engine, client=client, prefix=prefix, buffer_bytes=buffer_bytes)
    same_machine = sum(1 for _, m in ids if m == ids[rank][1])
    local = join_local(f"{prefix}/h{lay.h}", lay.i, len(lay.hosts[lay.h]), same_machine > _comm._cpus())
    try:
        inter, world, store = _inter.groups(
            engine, client, prefix, rank, size, lay, ctx, timeout, init_timeout
        )
        name = f"shard{lay.i}" if lay.uniform else "leaders"
        native = _C.HierComm(
            local._c,
            rank,
            size,
            lay.host_of,
            _engine(engine, inter, store, f"{prefix}/{name}"),
            _engine(engine, world, store, f"{prefix}/world"),
            float(timeout),
            f"hier:{prefix}",
        )
    except BaseException:
        local.finalize()
        raise
    comm = HierCommunicator(native, lay, local, engine, timeout=timeout, ctx=ctx, keep=keep)
    # No rank leaves init while another still connects its engine groups: a rank that failed its
    # first call right away would otherwise close its connections under a peer's connect, which
    # then fails its init with a closed connection instead of raising that call's error.
    try:  # through the store: a barrier on comm would take its call #1
        if client.add(f"{prefix}/engines-up", 1) == size:
            client.set(f"{prefix}/engines-all-up", b"1")
        client.get(f"{prefix}/engines-all-up", timeout=init_timeout)
    except BaseException:
        comm.finalize()
        raise
    return comm
