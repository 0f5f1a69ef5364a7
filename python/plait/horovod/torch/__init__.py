"""plait.horovod.torch: `import plait.horovod.torch as hvd` in place of `import horovod.torch as hvd`.

The whole public horovod.torch 0.28 API over plait's collectives; see docs/horovod.md for what
differs (no Adasum, no MPI ops; CUDA tensors run on plait's GPU path)."""

# ruff: noqa: F401  (this module re-exports horovod.torch's names)
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..common.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from . import elastic
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [n for n in dir() if not n.startswith("_")]
