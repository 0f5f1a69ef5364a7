"""torch.distributed backend "plait": c10d collectives on plait's shared-memory communicators.

    import torch.distributed as dist
    import plait.torch                       # registers the backend
    dist.init_process_group("plait")         # torchrun / plait-run, env://, tcp://, file://

Every process group (the default one and each dist.new_group) gets its own plait communicator,
rendezvoused through the store torch hands the backend. CUDA tensors (allreduce, reduce_scatter
and all_gather of contiguous tensors, plait's dtypes and ops) run on plait's GPU path on torch's
current stream; everything else takes CPU tensors.
Errors are torch.distributed.DistBackendError subclasses that are also plait's classes.
`pg_options=plait.torch.Options(buffer_bytes=...)` sets a group's staging size.
"""
import atexit

import torch.distributed as dist

from ._errors import (PlaitBackendError, PlaitInvalidArgument, PlaitMismatchError,  # noqa: F401
                      PlaitPeerLostError, PlaitTimeoutError, PlaitUnsupportedError)
from ._group import Options, ProcessGroupPlait, shutdown_all

__all__ = ["ProcessGroupPlait", "Options", "BACKEND", "PlaitBackendError", "PlaitInvalidArgument",
           "PlaitMismatchError", "PlaitTimeoutError", "PlaitPeerLostError", "PlaitUnsupportedError"]

BACKEND = "plait"


def _create(opts, pg_options):
    """c10d's creator (extended API): one ProcessGroupPlait for the group described by opts."""
    return ProcessGroupPlait(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                             group_id=opts.group_id, options=pg_options)


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
atexit.register(shutdown_all)
