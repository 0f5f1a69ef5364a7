"""TorchState: a model, an optimizer, samplers and plain attributes, saved at commit(),
restored after a failure and synced from rank 0 after a reset."""

import copy

import torch

from ...common.elastic import ObjectState
from ..functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ..mpi_ops import rank
from .sampler import ElasticSampler


class StateHandler:
    def __init__(self, value):
        self.value = value

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def set_value(self, value):
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """A model or optimizer: saved and restored through its state_dict."""

    def __init__(self, value):
        super().__init__(value)
        self.save()

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)


class ModelStateHandler(_StateDictHandler):
    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    def __init__(self, sampler):
        super().__init__(sampler)
        self.save()

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)

    def sync(self):
        # Every rank processed its own part of the epoch: the union is what the new world skips.
        state = self.value.state_dict()
        done = set().union(*allgather_object(state["processed_indices"], name="sampler.processed"))
        state = broadcast_object(state, root_rank=0, name="sampler.state")
        state["processed_indices"] = done
        self.value.load_state_dict(state)


def _handler(value):
    if isinstance(value, torch.nn.Module):
        return ModelStateHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return OptimizerStateHandler(value)
    if isinstance(value, ElasticSampler):
        return SamplerStateHandler(value)
    return None


class TorchState(ObjectState):
    """TorchState(model, optimizer, sampler=..., epoch=0, batch=0): modules, optimizers and
    ElasticSamplers get state-dict handlers; everything else is a plain attribute."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for k, v in kwargs.items():
            h = _handler(v) if v is not None else None
            if h is not None:
                handlers[k] = h
            elif v is not None or k not in ("model", "optimizer"):
                plain[k] = v
        object.__setattr__(self, "_handlers", handlers)
        for k, h in handlers.items():
            object.__setattr__(self, k, h.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self):
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self):
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self):
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)
