"""plait.horovod: Horovod's horovod.torch API on plait's collectives.

Change `import horovod.torch as hvd` into `import plait.horovod.torch as hvd`; the module tree
(plait.horovod.torch.{mpi_ops,functions,optimizer,compression,sync_batch_norm,elastic} and
plait.horovod.common.{util,exceptions,elastic,process_sets}) mirrors Horovod 0.28's, so an alias
package can map `horovod.*` onto it. See docs/horovod.md.
"""

__version__ = "0.28.1"
