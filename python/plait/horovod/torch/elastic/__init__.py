"""hvd.elastic for torch: run, TorchState, ObjectState, ElasticSampler (see common/elastic.py)."""

from ...common.elastic import ObjectState as _CommonObjectState
from ...common.elastic import State, run_fn
from ..functions import broadcast_object
from ..mpi_ops import init, rank, shutdown
from .sampler import ElasticSampler
from .state import TorchState


class ObjectState(_CommonObjectState):
    def __init__(self, **kwargs):
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)


def run(func):
    """Decorator for an elastic training function f(state, ...): on HorovodInternalError the
    state is restored to its last commit; after either that or HostsUpdatedInterrupt this rank
    leaves, joins the world the launcher forms next, syncs the state and calls f again."""
    return run_fn(func, _reset)


def _reset():
    shutdown()
    init()


__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]
