"""plait's exception classes; the C++ binding raises these, matched one-to-one to plait::ErrorKind."""

import builtins
import numbers


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


def number(value, what):
    """value as a float, or InvalidArgument naming `what` when it is no real number (a bool or a
    numeric string is not one either: both are more likely slips than meant as seconds)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{what} must be a number of seconds, got {type(value).__name__} {value!r}")
    return float(value)


def seconds(value, what, zero_means="do not wait"):
    """A deadline in seconds: a real number >= 0 (0: {zero_means}; inf: no deadline). NaN and
    negative values are refused, never read as "no deadline"."""
    v = number(value, what)
    if not v >= 0:
        raise InvalidArgument(f"{what} must be a number of seconds >= 0 (0: {zero_means}), got {value!r}")
    return v
