"""Communication buffers in plait shared memory for DDP and FSDP2.

Neither DDP's Reducer nor FSDP2's default collectives ask the process group for their memory
(FSDP2 does only after set_allocate_memory_from_process_group_for_comm(True)), so a model opts
in once: `plait.torch.use_shared_buffers(model)`. Then peers on the host map the buffers and
plait's collectives on them skip the kernel copies (plait-bench --shared shows what that buys).
"""

import torch
import torch.distributed as dist

from . import _native


def shared_allreduce_hook(process_group, bucket):
    """A DDP communication hook: torch's default allreduce hook (divide by the world size, then
    sum), on the bucket moved into plait shared memory the first time it is seen. DDP owns its
    buckets, so moving one in place is safe; gradients that are bucket views move with it.
    Results are bitwise those of DDP without a hook."""
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    _native.share_storage(buf)
    buf.div_(group.size())
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def use_shared_buffers(model):
    """Puts the communication buffers of `model` in plait shared memory: a DDP model gets
    shared_allreduce_hook (on its process group); every FSDP2 module in a model allocates its
    all-gather and reduce-scatter buffers through its process group (plait's allocateTensor).
    Returns the model. Needs the native backend (plait.torch.native()) to take effect; on the
    Python backend the collectives run as before."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model.register_comm_hook(model.process_group, shared_allreduce_hook)
        return model
    found = False
    for m in model.modules():
        if hasattr(m, "set_allocate_memory_from_process_group_for_comm"):
            m.set_allocate_memory_from_process_group_for_comm(True)
            found = True
    if not found:
        raise TypeError(
            "plait.torch.use_shared_buffers: expected a DistributedDataParallel model or a model with "
            f"fully_shard (FSDP2) modules, got {type(model).__name__}"
        )
    return model


def is_shared(tensor: torch.Tensor) -> bool:
    """Whether all of `tensor`'s memory is plait shared memory (peers on the host map it)."""
    from .. import _C

    n = tensor.numel() * tensor.element_size()
    return tensor.device.type == "cpu" and n > 0 and bool(_C.is_shared(tensor.data_ptr(), n))
