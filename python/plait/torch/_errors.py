"""plait's errors as torch.distributed errors.

Each class is both a torch.distributed.DistBackendError (what c10d backends raise, and what
torch's own error handling catches) and the plait class it stands for, so `except
plait.TimeoutError` and `except dist.DistBackendError` both work. The message is plait's.
"""

import torch.distributed as dist

import plait


class PlaitBackendError(dist.DistBackendError, plait.PlaitError):
    """A plait failure inside a torch.distributed call (the communicator is aborted)."""


class PlaitInvalidArgument(PlaitBackendError, plait.InvalidArgument):
    """Bad input to a collective (also a ValueError)."""


class PlaitMismatchError(PlaitBackendError, plait.MismatchError):
    """The ranks of the group made calls that do not match."""


class PlaitTimeoutError(PlaitBackendError, plait.TimeoutError):
    """A deadline passed (also a builtin TimeoutError)."""


class PlaitPeerLostError(PlaitBackendError, plait.PeerLostError):
    """A rank of the group died."""


class PlaitUnsupportedError(PlaitBackendError, NotImplementedError):
    """Something torch.distributed allows that this backend does not do (the group stays usable)."""


_MAP = [
    (plait.InvalidArgument, PlaitInvalidArgument),
    (plait.MismatchError, PlaitMismatchError),
    (plait.TimeoutError, PlaitTimeoutError),
    (plait.PeerLostError, PlaitPeerLostError),
    (plait.PlaitError, PlaitBackendError),
]


def to_torch(e, where=""):
    """The torch-side exception for e (e itself when it already is one, or is not plait's)."""
    if isinstance(e, dist.DistError) or not isinstance(e, plait.PlaitError):
        return e
    for plait_cls, torch_cls in _MAP:
        if isinstance(e, plait_cls):
            err = torch_cls(f"{where}: {e}" if where else str(e))
            err.__cause__ = e
            err.flight = e.flight  # the flight recorder's report, when the error has one
            return err
    return e  # pragma: no cover - _MAP ends with the base class


_FLIGHT_KINDS = (3, 4, 5)  # the C API's mismatch, timeout, peer lost: the kinds plait reports on


def attach_flight(err, group, kind):
    """Gives a native backend error the flight report of its group's communicator (err.flight),
    as plait's own errors carry it; left None when the group or its report is gone."""
    if kind not in _FLIGHT_KINDS:
        return
    from plait import _flight

    from . import _native

    comm = _native._comms.get(group)
    if comm is None:
        return
    try:
        err.flight = _flight.dump(comm)
    except Exception:  # noqa: BLE001 - the report is a help, never a second failure
        pass


def mapped(fn):
    """Raises plait errors out of a group method as torch errors naming the group and the call."""

    def method(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except plait.PlaitError as e:
            raise to_torch(e, f"plait {fn.__name__} on {self._label}") from None

    method.__name__ = fn.__name__
    method.__doc__ = fn.__doc__
    return method
