"""The native c10d backend: csrc/torch/ compiled against the installed torch at first use.

pip builds plait without torch (its build environment has none), so the backend's C++ sources
ship in the package and are compiled here, once per (torch version, plait version, sources,
Python), into $PLAIT_CACHE_DIR (default ~/.cache/plait) under a file lock: many ranks import at
once, one compiles, the rest wait and load. The module reaches plait's core only through
plait._C's C API (bindings/capi.h), so there is one core in the process.

When it cannot be built (no C++ compiler, no ninja, no Python headers, a cache directory that
cannot be written), `import plait.torch` fails with one NativeBuildError naming each missing
piece and how to get it, instead of running something else. While it compiles, stderr gets one
line saying so (dots follow on a terminal).

CUDA tensors take the C API's device buffers (csrc/torch/gpu.cc): the group's communicator gets
its GPU queue at the first CUDA tensor (attach_gpu), as plait's own first GPU call gives it one.

Groups across hosts are native too: their communicator is _C.HierComm, which the C API drives
like a flat one, and the module also hands the multi-host communicator its engine between hosts
(make_gloo_engine: torch's own ProcessGroupGloo behind hier/engine.h).
"""

import fcntl
import hashlib
import os
import shutil
import sys
import sysconfig
import threading
import time
import weakref

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOURCES = (
    "torch/backend.cc",
    "torch/work.cc",
    "torch/collectives.cc",
    "torch/ops.cc",
    "torch/gpu.cc",
    "torch/testing.cc",
    "torch/gloo_engine.cc",
    "torch/engine_calls.cc",
    "torch/horovod.cc",
    "torch/horovod_fast.cc",
)
_HEADERS = ("torch/backend.h", "torch/engines.h", "torch/horovod.h", "bindings/capi.h", "hier/engine.h")
_module = None
_tried = False
_error = None  # the NativeBuildError the build raised, raised again on each later use
_comms = weakref.WeakValueDictionary()  # group name -> plait communicator of a native group


def _csrc():
    """The sources: shipped in the package (plait/_csrc), or the checkout's csrc/."""
    for d in (os.path.join(_PKG, "_csrc"), os.path.join(os.path.dirname(os.path.dirname(_PKG)), "csrc")):
        if all(os.path.isfile(os.path.join(d, f)) for f in _SOURCES + _HEADERS):
            return d
    return None


class NativeBuildError(ImportError):
    """plait's torch backend cannot be compiled here; the message names what is missing."""


def _cache_root():
    return os.environ.get("PLAIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "plait")


def _writable_dir(path):
    """'' if path is (or can be made) a directory this process writes in, else why not."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    return "" if os.access(path, os.W_OK | os.X_OK) else "not writable"


def missing():
    """What compiling the backend needs and this machine lacks: a list of one-line items, each
    naming the piece and how to get it (empty when everything is there)."""
    out = []
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None and not (cxx == "c++" and (shutil.which("g++") or shutil.which("clang++"))):
        out.append(f"a C++17 compiler ({cxx!r} is not on PATH): apt-get install g++ (or set CXX to one)")
    if shutil.which("ninja") is None:
        out.append("ninja (not on PATH): pip install ninja")
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include, "Python.h")):
        ver = "%d.%d" % sys.version_info[:2]
        out.append(f"the Python {ver} headers ({include}/Python.h): apt-get install python{ver}-dev")
    root = _cache_root()
    why = _writable_dir(root)
    if why:
        out.append(f"a writable cache directory ({root}: {why}): set PLAIT_CACHE_DIR to one")
    return out


class _Progress:
    """The one line a compile prints; on a terminal, a dot every few seconds until it ends."""

    def __init__(self, text, stream=None, interval=3.0):
        self._s = stream or sys.stderr
        self._interval = interval
        self._tty = self._s.isatty()
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._s.write(text + ("" if self._tty else "\n"))
        self._s.flush()
        self._thread = None
        if self._tty:
            self._thread = threading.Thread(target=self._dots, daemon=True)
            self._thread.start()

    def _dots(self):
        while not self._stop.wait(self._interval):
            self._s.write(".")
            self._s.flush()

    def end(self, ok):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._s.write(f" {'done' if ok else 'failed'} ({time.monotonic() - self._t0:.0f} s)\n")
            self._s.flush()


def _build():
    import torch
    from torch.utils import cpp_extension

    import plait

    src = _csrc()
    if src is None:
        raise NativeBuildError(
            "plait.torch: the native backend's C++ sources are not installed with plait; reinstall plait"
        )
    h = hashlib.sha256()
    for f in _SOURCES + _HEADERS:
        with open(os.path.join(src, f), "rb") as fh:
            h.update(f.encode() + b"\0" + fh.read())
    h.update(f"{torch.__version__}|{plait.__version__}|{sys.version_info[:2]}".encode())
    name = "plait_torch_" + h.hexdigest()[:16]
    build_dir = os.path.join(_cache_root(), name)
    built = os.path.isfile(os.path.join(build_dir, name + ".so"))
    lacking = [] if built else missing()
    if lacking:
        raise NativeBuildError(
            f"plait.torch: cannot compile the native torch backend for torch {torch.__version__}; "
            "missing: " + "; ".join(lacking)
        )
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Under this lock no other plait process builds here, so torch's own baton file is the
        # leftover of a build that was killed; torch would wait for it forever.
        try:
            os.remove(os.path.join(build_dir, "lock"))
        except FileNotFoundError:
            pass
        progress = None
        if not os.path.exists(os.path.join(build_dir, name + ".so")):
            progress = _Progress(
                f"plait.torch: compiling the native backend for torch {torch.__version__} "
                f"(once per torch version, about a minute) into {build_dir}"
            )
        ok = False
        try:
            mod = cpp_extension.load(
                name=name,
                sources=[os.path.join(src, f) for f in _SOURCES],
                extra_include_paths=[src],
                build_directory=build_dir,
                extra_cflags=["-O2"],
                verbose=False,
            )
            ok = True
            return mod
        finally:
            if progress is not None:
                progress.end(ok)


def load():
    """The compiled module. Raises NativeBuildError when it cannot be built."""
    global _module, _tried, _error
    if _tried:
        if _error is not None:
            raise NativeBuildError(str(_error))
        return _module
    _tried = True
    try:
        _module = _build()
    except NativeBuildError as e:
        _error = e
        raise
    except Exception as e:  # noqa: BLE001 - the compiler's own failure, said once with its text
        _error = NativeBuildError(f"plait.torch: the native backend did not build: {str(e).strip()}")
        raise _error from e
    return _module


def create(opts, buffer_bytes):
    """A native Backend for the group c10d describes in opts, or the communicator plait.init
    gave when it is no C++ one the C API can drive (the Python HierCommunicator of before
    _C.HierComm)."""
    import plait
    from plait import _C

    from . import _errors
    from ._store import TorchStore

    secs = opts.timeout.total_seconds() if opts.timeout is not None else None
    try:
        comm = plait.init(
            opts.group_rank,
            opts.group_size,
            store=TorchStore(opts.store, secs),
            timeout=secs,
            init_timeout=secs,  # the group's timeout bounds its creation too, as gloo's does
            buffer_bytes=buffer_bytes,
            set_default=False,
        )
    except plait.PlaitError as e:
        raise _errors.to_torch(e, f"plait: creating group {opts.group_id!r}") from None
    native = getattr(comm, "_c", None)
    if not isinstance(native, _C._Comm):  # every C++ communicator (flat, or multi-host: HierComm)
        return comm
    comm.label = f"pg:{opts.group_id}"  # flight reports and PLAIT_TRACE tracks name the group
    backend = _module.create(
        _C._capi, _C._comm_capsule(native), comm, opts.group_rank, opts.group_size, secs if secs else 300.0
    )
    _comms[str(opts.group_id)] = comm
    return backend


# plait's error classes as the C API numbers their kinds (capi.h's plait_error).
_KINDS = {"InvalidArgument": 2, "MismatchError": 3, "TimeoutError": 4, "PeerLostError": 5}


def attach_gpu(comm, coll, device, timeout_s):
    """Gives a native group's communicator its GPU queue on CUDA device `device`, in the group's
    first call on CUDA tensors (`coll`, plait's name of the call about to run), as C++ asks for it
    once per group: every rank creates it in that call (plait._gpu), so a rank that cannot (a
    build without CUDA, no visible device, NCCL not loaded) makes every rank raise. Returns
    (kind, message): (0, "") once the queue is there, else the error's C API kind and text."""
    from plait import _errors, _gpu

    what = f"CUDA tensor on cuda:{device}"
    try:
        _gpu.check_usable(comm, coll, what)
        if coll in ("send", "recv") and comm._gpu is None and comm.size > 2:
            # Creating the GPU queue is a collective: two ranks of a larger group cannot.
            raise _errors.InvalidArgument(
                f"rank {comm.rank}: {coll} ({what}): the first CUDA call of a group of {comm.size} "
                f"ranks must be a collective (it creates the group's GPU communicator on every "
                f"rank); make one, e.g. a broadcast of a CUDA tensor, before send/recv"
            )
        _gpu._communicator(comm, device, timeout_s, f"rank {comm.rank}: {coll} ({what})")
    except _errors.PlaitError as e:
        kind = next((_KINDS[c.__name__] for c in type(e).__mro__ if c.__name__ in _KINDS), 1)
        return kind, str(e)
    return 0, ""


def split(store, rank, size, timeout_s, group_name):
    """The Backend of a group split off a native one (c10d's split_group), as C++ asks for it."""
    from datetime import timedelta

    class _Opts:
        pass

    opts = _Opts()
    opts.store, opts.group_rank, opts.group_size = store, rank, size
    opts.timeout, opts.group_id = timedelta(seconds=timeout_s), group_name
    from torch._C._distributed_c10d import Backend

    made = create(opts, None)
    if not isinstance(made, Backend):
        raise RuntimeError("plait: split_group needs a communicator the native backend drives")
    return made


def share_storage(tensor):
    """Moves `tensor`'s storage into plait shared memory in place (see backend.cc): True if it is
    plait's now; False when the native backend is not built or the storage is not torch's own
    CPU allocation (from_numpy, mmap, pinned)."""
    if load() is None:
        return False
    from plait import _C

    return bool(_module.share_storage(tensor, _C._capi))
