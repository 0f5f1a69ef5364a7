"""Process sets (horovod.common.process_sets): collectives on a subset of the ranks.

Each set is a plait communicator split from the world's; its ops are negotiated by the one
coordinator with everyone else's, so sets may run concurrently and overlap. Sets given to
hvd.init(process_sets=[...]) are static; add_process_set / remove_process_set change them at run
time and, as in Horovod, must be called by every rank in the same order."""

from typing import List, Optional, Sequence, Union


class ProcessSet:
    """A set of ranks; `process_set_id` is assigned when it is registered (the global set is 0)."""

    def __init__(self, ranks: Union[Sequence[int], object]):
        if hasattr(ranks, "Get_group"):  # an mpi4py communicator: its ranks in the world
            from mpi4py import MPI

            world = MPI.COMM_WORLD.Get_group()
            ranks = MPI.Group.Translate_ranks(ranks.Get_group(), list(range(ranks.Get_size())), world)
        self.ranks: List[int] = sorted(int(r) for r in ranks)
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"process set ranks repeat: {list(ranks)}")
        self.process_set_id: Optional[int] = None

    def _invalidate(self):
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set (None before it is registered)."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set; None if it is not a member or not registered."""
        from . import basics

        if self.process_set_id is None or basics.rank() not in self.ranks:
            return None
        return self.ranks.index(basics.rank())

    def included(self) -> Optional[bool]:
        from . import basics

        if self.process_set_id is None:
            return None
        return basics.rank() in self.ranks

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and other.ranks == self.ranks

    __hash__ = None


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _Entry:
    __slots__ = ("ranks", "comm")

    def __init__(self, ranks, comm):
        self.ranks, self.comm = ranks, comm


class Registry:
    """process set id -> (ranks, plait communicator or None where this rank is no member)."""

    def __init__(self, world_comm, size):
        self._sets = {0: _Entry(list(range(size)), world_comm)}
        self.next_id = 1

    def get(self, ps_id):
        return self._sets.get(ps_id)

    def __getitem__(self, ps_id):
        return self._sets[ps_id]

    def ids(self):
        return sorted(self._sets)

    def find(self, ranks):
        for i, e in self._sets.items():
            if i != 0 and e.ranks == ranks:
                return i
        return None

    def register(self, ps_id, ranks, comm):
        self._sets[ps_id] = _Entry(list(ranks), comm)
        self.next_id = max(self.next_id, ps_id + 1)

    def unregister(self, ps_id):
        e = self._sets.pop(ps_id, None)
        if e is not None and e.comm is not None:
            e.comm.finalize()

    def close(self):
        for i, e in list(self._sets.items()):
            if i != 0 and e.comm is not None:
                e.comm.finalize()
        self._sets = {}


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Registers a new set at run time (every rank calls it, in the same order). Returns it with
    its id. A set with the same ranks already registered is a ValueError, as in Horovod."""
    from . import basics

    return basics._add_process_set(
        process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    )


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a set (every rank calls it). False if it was not registered; the global set
    cannot be removed."""
    from . import basics

    return basics._remove_process_set(process_set)
