"""The native c10d backend: csrc/torch/ compiled against the installed torch at first use.

pip builds plait without torch (its build environment has none), so the backend's C++ sources
ship in the package and are compiled here, once per (torch version, plait version, sources,
Python), into $PLAIT_CACHE_DIR (default ~/.cache/plait) under a file lock: many ranks import at
once, one compiles, the rest wait and load. The module reaches plait's core only through
plait._C's C API (bindings/capi.h), so there is one core in the process.

PLAIT_TORCH_NATIVE: unset = native when it builds (else the Python backend, with a one-line
note); 0 = always the Python backend; 1 = native or an error.
"""

import fcntl
import hashlib
import os
import sys
import weakref

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOURCES = ("torch/backend.cc", "torch/work.cc", "torch/collectives.cc", "torch/ops.cc")
_HEADERS = ("torch/backend.h", "bindings/capi.h")
_module = None
_tried = False
_comms = weakref.WeakValueDictionary()  # group name -> plait communicator of a native group


def _csrc():
    """The sources: shipped in the package (plait/_csrc), or the checkout's csrc/."""
    for d in (os.path.join(_PKG, "_csrc"), os.path.join(os.path.dirname(os.path.dirname(_PKG)), "csrc")):
        if all(os.path.isfile(os.path.join(d, f)) for f in _SOURCES + _HEADERS):
            return d
    return None


def _build():
    import torch
    from torch.utils import cpp_extension

    import plait

    src = _csrc()
    if src is None:
        raise RuntimeError("the backend's C++ sources are not installed with plait")
    h = hashlib.sha256()
    for f in _SOURCES + _HEADERS:
        with open(os.path.join(src, f), "rb") as fh:
            h.update(f.encode() + b"\0" + fh.read())
    h.update(f"{torch.__version__}|{plait.__version__}|{sys.version_info[:2]}".encode())
    name = "plait_torch_" + h.hexdigest()[:16]
    cache = os.environ.get("PLAIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "plait")
    build_dir = os.path.join(cache, name)
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(build_dir, name + ".so")):
            print(
                f"plait.torch: compiling the native backend for torch {torch.__version__} into {build_dir} "
                "(once)",
                file=sys.stderr,
                flush=True,
            )
        return cpp_extension.load(
            name=name,
            sources=[os.path.join(src, f) for f in _SOURCES],
            extra_include_paths=[src],
            build_directory=build_dir,
            extra_cflags=["-O2"],
            verbose=False,
        )


def load():
    """The compiled module, or None (the Python backend then serves the groups)."""
    global _module, _tried
    want = os.environ.get("PLAIT_TORCH_NATIVE", "")
    if want == "0":
        return None  # read at each group's creation, so a process may mix (tests do)
    if _tried:
        return _module
    _tried = True
    if not want:
        import torch

        import plait

        if plait.build_info()["cuda"] and torch.cuda.is_available():
            return None  # CUDA tensors take plait's GPU path, which only the Python backend has yet
    try:
        _module = _build()
    except Exception as e:  # noqa: BLE001 - any failure means: fall back, or raise when asked for
        if want == "1":
            raise RuntimeError(f"plait.torch: the native backend did not build: {e}") from e
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"plait.torch: native backend unavailable ({first}); using the Python backend "
            "(PLAIT_TORCH_NATIVE=0 silences this)",
            file=sys.stderr,
            flush=True,
        )
    return _module


def create(opts, buffer_bytes):
    """A native Backend for the group c10d describes in opts, or None when plait.init gave a
    communicator the C API cannot drive (a multi-host one)."""
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
    if not isinstance(native, _C.Communicator):
        return comm
    comm.label = f"pg:{opts.group_id}"  # flight reports and PLAIT_TRACE tracks name the group
    backend = _module.create(
        _C._capi, _C._comm_capsule(native), comm, opts.group_rank, opts.group_size, secs if secs else 300.0
    )
    _comms[str(opts.group_id)] = comm
    return backend


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
