"""plait's exception classes; the C++ binding raises these, matched one-to-one to plait::ErrorKind."""
import builtins


class PlaitError(Exception):
    """Base class of every error plait raises.

    TimeoutError, PeerLostError and MismatchError from a communicator carry `flight`: the flight
    recorder's report (a dict: every rank's last calls, "summary" the text appended to the
    message); None otherwise, or with PLAIT_FLIGHT=0.
    """

    flight = None


class InvalidArgument(PlaitError, ValueError):
    """A call's arguments are wrong on this rank (shape, dtype, op, peer, ...)."""


class MismatchError(PlaitError):
    """The ranks made calls that do not match each other."""


class TimeoutError(PlaitError, builtins.TimeoutError):  # noqa: A001 - shadows the builtin on purpose
    """A deadline passed; the message names what was still missing."""


class PeerLostError(PlaitError):
    """Another rank died or its connection broke."""
