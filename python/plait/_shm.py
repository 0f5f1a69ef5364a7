"""Names of plait's POSIX shared-memory segments, and removal of the ones their creator left behind.

A segment is /dev/shm/plait-<creator pid>-<32 hex>; the pid in the name is what lets a later run
tell a leak (creator dead) from a segment in use, without any registry.
"""

import os
import re
import secrets
import stat

SEGMENT_PREFIX = "plait-"
_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"(\d+)-")


def segment_name(pid=None):
    """A fresh shm_open() name for a segment created by pid (default: this process)."""
    return f"/{SEGMENT_PREFIX}{os.getpid() if pid is None else pid}-{secrets.token_hex(16)}"


def list_segments(shm_dir="/dev/shm"):
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(SEGMENT_PREFIX))


def _dead(pid):
    if not os.path.isdir("/proc/self"):
        # Without /proc every pid would look dead; kill(0) is the conservative fallback (a zombie
        # counts as alive there, so nothing in use is removed).
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False
    # The state follows the parenthesised command name, which may itself contain ") ".
    return line[line.rfind(b")") + 2 :][:1] in (b"Z", b"X")


def sweep_stale(shm_dir="/dev/shm"):
    """Removes this user's plait segments whose creator is dead; returns the names removed."""
    removed = []
    for name in list_segments(shm_dir):
        m = _NAME.match(name)
        if not m:
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode) or not _dead(int(m.group(1))):
            continue
        try:
            os.unlink(path)
        except OSError:  # another sweeper got there first, or the directory forbids it
            continue
        removed.append(name)
    return removed
