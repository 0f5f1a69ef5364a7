"""torch.distributed backend "plait": c10d collectives on plait's shared-memory communicators.

    import torch.distributed as dist
    import plait.torch                       # registers the backend
    dist.init_process_group("plait")         # torchrun / plait-run, env://, tcp://, file://

Every process group (the default one and each dist.new_group) gets its own plait communicator,
rendezvoused through the store torch hands the backend, and one native (C++) c10d backend
(csrc/torch/, compiled at first import) drives it: on one host or many, CPU or CUDA tensors.
Errors are torch.distributed.DistBackendError subclasses that are also plait's classes.
`pg_options=plait.torch.Options(buffer_bytes=...)` sets a group's staging size.
`plait.torch.empty(*size, dtype=None)` (alias `zeros`) gives a CPU tensor in plait shared memory
(see plait.empty): collectives on it reach peers through mappings instead of kernel copies.
`plait.torch.use_shared_buffers(model)` does the same for a DDP or FSDP2 model's communication
buffers.
"""

import torch.distributed as dist

from ._errors import (
    PlaitBackendError,
    PlaitInvalidArgument,
    PlaitMismatchError,  # noqa: F401
    PlaitPeerLostError,
    PlaitTimeoutError,
    PlaitUnsupportedError,
)
from . import _native
from .. import _torch_autoload
from ._options import Options
from ._shared_comm import is_shared, shared_allreduce_hook, use_shared_buffers

__all__ = [
    "Options",
    "BACKEND",
    "communicator",
    "native",
    "empty",
    "zeros",
    "is_shared",
    "use_shared_buffers",
    "shared_allreduce_hook",
    "PlaitBackendError",
    "PlaitInvalidArgument",
    "PlaitMismatchError",
    "PlaitTimeoutError",
    "PlaitPeerLostError",
    "PlaitUnsupportedError",
]

BACKEND = "plait"


def empty(*size, dtype=None):
    """A contiguous CPU tensor of `size` (ints, or one tuple / torch.Size) and `dtype` (default:
    torch's default dtype) in plait shared memory, zero-filled: what torch.empty would give, but
    peers on the host map it, so plait's collectives on it skip the kernel copies. Any dtype
    works, bfloat16 included."""
    import torch

    from .. import _shared

    shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
    dtype = dtype or torch.get_default_dtype()
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(_shared.empty(_shared._count(shape) * esize, "uint8"))
    return raw.view(dtype).view(shape)


zeros = empty


def _create(opts, pg_options):
    """c10d's creator (extended API): the native Backend for the group described by opts."""
    buffer_bytes = pg_options.buffer_bytes if isinstance(pg_options, Options) else None
    _native.load()
    return _native.create(opts, buffer_bytes)


def communicator(group=None):
    """The plait communicator under a "plait" process group (default: the world)."""
    pg = group if group is not None else dist.group.WORLD
    comm = _native._comms.get(pg.group_name)
    if comm is None:
        raise PlaitInvalidArgument(f"plait.torch.communicator: group {pg.group_name!r} is not a plait group")
    return comm


def native():
    """Whether new "plait" groups get the native (C++) backend: always, once plait.torch imported
    (kept for scripts that asked; the Python backend is gone)."""
    return _native.load() is not None


_plugin = dist.Backend._plugins.get(BACKEND.upper())
if _plugin is None or _plugin.creator_fn is _torch_autoload._create:  # replaces the autoload stub
    native()  # compiles the native backend now (NativeBuildError here when it cannot be)
    # CPU and CUDA tensors (CUDA through plait's C API device buffers).
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
