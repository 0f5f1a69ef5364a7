"""Elastic training (horovod.common.elastic): State, ObjectState and the run wrapper.

Under `plait-run --min-np A --max-np B` a rank that dies makes the survivors' ops fail with
HorovodInternalError; run() then restores the last commit, leaves the world and joins the next
one the launcher forms (re-rendezvous, see _rendezvous.py), syncs the state from the new rank 0
and calls the function again. A worker the launcher adds makes the others' next commit() raise
HostsUpdatedInterrupt, and they re-form the world with it."""

import copy
import functools

from . import _rendezvous
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt


class State:
    """What survives a reset: save() at commit, restore() after a failure, sync() from rank 0."""

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called (in order) after every reset, e.g. to rescale the learning rate."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._host_messages_seen = _rendezvous.generation()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        pass

    def commit(self):
        """Saves the state, then raises HostsUpdatedInterrupt if the launcher has formed a new
        world that this rank is to join (a worker was added)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        if _rendezvous.update_pending():
            raise HostsUpdatedInterrupt(False)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        pass


class ObjectState(State):
    """State of plain Python attributes (kwargs), kept as deep copies and synced by broadcast_object."""

    def __init__(self, bcast_object, get_rank, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        new_state = {}
        for attr in self._saved_state:
            new_state[attr] = copy.deepcopy(getattr(self, attr))
        self._saved_state = new_state

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


def run_fn(func, reset):
    """The body of hvd.elastic.run: retries func(state) across resets until it returns."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            reset()
            state.on_reset()

    return wrapper
