"""hvd.init(comm=...): Horovod's world made of some of the launcher's ranks.

Horovod takes a list of ranks (of MPI_COMM_WORLD) or an MPI communicator; only the processes in it
call init, and they become a world of their own: hvd.rank() is the position in the list (the
communicator's rank order), hvd.size() its length. Here that world is a plait communicator of
those processes alone, met under a store key prefix of its own so that other worlds (the other
ranks', a later init) never mix with it. The store is the launcher's (PLAIT_STORE, MASTER_ADDR and
MASTER_PORT), or, for an mpi4py communicator or under mpirun without one, a store that the first
member serves on a fresh port and announces over MPI to the members only.
"""

import os

from plait import _bootstrap, _errors, _store


def members(comm, world_rank, world_size):
    """The world ranks of `comm` (a list of ranks or an mpi4py communicator), in its rank order,
    and the mpi4py communicator when one was given."""
    if hasattr(comm, "Get_group") and hasattr(comm, "bcast"):
        from mpi4py import MPI

        ranks = MPI.Group.Translate_ranks(
            comm.Get_group(), list(range(comm.Get_size())), MPI.COMM_WORLD.Get_group()
        )
        return [int(r) for r in ranks], comm
    if isinstance(comm, (str, bytes)) or not hasattr(comm, "__iter__"):
        raise TypeError(
            f"rank {world_rank}: hvd.init(comm=...) takes a list of ranks or an mpi4py communicator, "
            f"got {type(comm).__name__}"
        )
    ranks = []
    for r in comm:
        if isinstance(r, bool) or not isinstance(r, int) and not hasattr(r, "__index__"):
            raise TypeError(f"rank {world_rank}: hvd.init(comm={list(comm)!r}): ranks must be integers")
        ranks.append(int(r))
    bad = [r for r in ranks if not 0 <= r < world_size]
    if not ranks or bad or len(set(ranks)) != len(ranks):
        raise ValueError(
            f"rank {world_rank}: hvd.init(comm={ranks!r}): the ranks must be distinct ranks of the "
            f"launcher's world of {world_size}" + (f" ({bad} are not)" if bad else "")
        )
    return ranks, None


def is_whole_world(ranks, world_size):
    return ranks == list(range(world_size))


def connect(ranks, world_rank, mpi_comm):
    """This process's plait communicator of the world `ranks`; (communicator, rank, size)."""
    if world_rank not in ranks:
        raise ValueError(
            f"rank {world_rank}: hvd.init(comm={ranks!r}): this process is not in the list; only the "
            "processes of a Horovod world call init with it (Horovod's own MPI_Comm_create_group "
            "would leave this rank without a communicator)"
        )
    rank, size = ranks.index(world_rank), len(ranks)
    timeout, init_timeout = _bootstrap._timeouts(None, None)
    keep = []
    if mpi_comm is None and _under_mpirun_without_store():
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        mpi_comm = world.Create_group(world.Get_group().Incl(ranks))  # collective over the members
        keep_mpi = mpi_comm
    else:
        keep_mpi = None
    try:
        if mpi_comm is not None:
            client = _announced_store(mpi_comm, keep, init_timeout)
        else:
            host, port, serve = _store.store_from_env(world_rank)
            if not os.environ.get("PLAIT_STORE") and 0 not in ranks:
                raise ValueError(
                    f"rank {world_rank}: hvd.init(comm={ranks!r}) without rank 0: nobody serves the "
                    "store at MASTER_PORT+1 (world rank 0 does); set PLAIT_STORE=host:port (plait-run "
                    "does) or pass an mpi4py communicator"
                )
            if serve:  # world rank 0 serves the launcher's store for every world it is in
                _bootstrap._serve_for_good(host, port)
            client = _store.Store(host, port, timeout=init_timeout)
            keep.append(client)
        prefix = "horovod-world/" + "-".join(map(str, ranks))
        comm = _bootstrap.init_in(
            client,
            prefix,
            rank,
            size,
            timeout=float(timeout),
            init_timeout=float(init_timeout),
            buffer_bytes=None,
            keep=keep,
        )
    except BaseException:
        from plait import _comm

        _comm.close_all(keep)
        raise
    finally:
        if keep_mpi is not None:
            keep_mpi.Free()
    return comm, rank, size


def _under_mpirun_without_store():
    return (
        "OMPI_COMM_WORLD_SIZE" in os.environ
        and not os.environ.get("PLAIT_STORE")
        and not os.environ.get("MASTER_PORT")
    )


def _announced_store(mpi_comm, keep, init_timeout):
    """A store served by the communicator's rank 0 on a fresh port, its address broadcast over
    the communicator (so only its members take part)."""
    import socket

    addr, err = None, None
    if mpi_comm.Get_rank() == 0:
        try:
            local, world = (os.environ.get(f"OMPI_COMM_WORLD_{k}SIZE") for k in ("LOCAL_", ""))
            one_host = mpi_comm.Get_size() == 1 or (local is not None and local == world)
            host = "127.0.0.1" if one_host else (os.environ.get("MASTER_ADDR") or socket.gethostname())
            server = _store.StoreServer(host if one_host else "0.0.0.0", 0, os.environ.get(_store.TOKEN_ENV))
            keep.append(server)
            addr = (host, server.port)
        except Exception as e:  # noqa: BLE001 - the members must hear why instead of waiting
            err = f"{type(e).__name__}: {e}"
    addr, err = mpi_comm.bcast((addr, err), root=0)
    if err is not None:
        raise _errors.PlaitError(
            f"hvd.init(comm=...): rank 0 of the communicator could not serve a store: {err}"
        )
    client = _store.Store(addr[0], addr[1], timeout=init_timeout)
    keep.append(client)
    return client
