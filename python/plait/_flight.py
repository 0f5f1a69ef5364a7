"""The flight recorder's reports as users see them: plait.dump, and plait-run's one summary.

A report (csrc/core/flight.cc builds it) is a dict: the reading rank, the error, and for every
rank its state, what it waits on, its last calls (oldest first) and anything in its ring that
was not trusted.
"""

import glob
import json
import os

from . import _errors

MARKER = "\nflight recorder"  # where an exception's message hands over to the report


def dump(comm, path=None):
    """comm's flight report as a dict; also written as JSON to `path` when given. A hierarchical
    communicator reports its host's ranks (their shared segment is where the rings are)."""
    local = getattr(comm, "local", None)
    if local is not None and not hasattr(getattr(comm, "_c", None), "flight_json"):
        return dump(local, path)
    native = getattr(comm, "_c", None)
    if native is None or not hasattr(native, "flight_json"):
        raise _errors.InvalidArgument(f"plait.dump needs a plait Communicator, got {type(comm).__name__}")
    text = native.flight_json()
    if path is not None:
        with open(os.fspath(path), "w") as f:
            f.write(text)
    return json.loads(text)


def message_only(text):
    """An exception's message without the flight report appended to it."""
    return text.split(MARKER, 1)[0]


def load_dir(directory):
    """The reports ranks wrote under plait-run --dump-on-error, by reading rank."""
    reports = {}
    for path in sorted(glob.glob(os.path.join(directory, "flight-rank*.json"))):
        try:
            with open(path) as f:
                rep = json.load(f)
            reports[int(rep["rank"])] = rep
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a rank killed mid-write leaves half a file: the others still tell
    return reports


def _cell(call, width):
    state = {"running": "RUNNING", "failed": "FAILED"}.get(call.get("state"), call.get("state", "?"))
    return f"{call.get('collective', '?')} #{call.get('call', '?')} {state}"[:width]


def side_by_side(reports, directory="", last=4, width=28, max_ranks=8):
    """One text for all ranks' reports: each rank's error, one view of every rank's last call,
    and their last `last` calls in columns."""
    if not reports:
        return ""
    view = reports[min(reports)]
    ranks = view.get("ranks", [])
    where = f" in {directory}" if directory else ""
    lines = [
        f"flight recorder: {len(reports)} report(s){where}; rank {view.get('rank')}'s view of "
        + f"{view.get('label', '?')}:"
    ]
    for r, rep in sorted(reports.items()):
        lines.append(f"  rank {r} raised: {message_only(str(rep.get('error', ''))).splitlines()[0][:200]}")
    for info in ranks:
        lines.append(f"  {info.get('summary', '')}")
    shown = ranks[:max_ranks]
    if shown:
        lines.append("  last calls, oldest first:")
        lines.append("    " + " | ".join(f"rank {i.get('rank')}".ljust(width) for i in shown))
        cols = [[_cell(c, width) for c in i.get("calls", [])[-last:]] for i in shown]
        depth = max(len(c) for c in cols)
        for row in range(depth):
            cells = [(c[row - (depth - len(c))] if row >= depth - len(c) else "") for c in cols]
            lines.append("    " + " | ".join(x.ljust(width) for x in cells))
    return "\n".join(lines)
