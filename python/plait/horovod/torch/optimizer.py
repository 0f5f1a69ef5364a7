"""horovod.torch.optimizer: DistributedOptimizer, which averages gradients across ranks while
backward still runs (a hook per parameter submits its allreduce as soon as its gradient is
accumulated; the coordinator fuses those that are ready together)."""

import contextlib
import warnings

import torch

from ..common.process_sets import global_process_set
from .compression import Compression
from .mpi_ops import (
    Adasum,
    Average,
    allreduce_async_,
    grouped_allreduce_async_,
    sparse_allreduce_async,
    synchronize,
)


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        named_parameters,
        compression,
        backward_passes_per_step=1,
        op=Average,
        gradient_predivide_factor=1.0,
        groups=None,
        sparse_as_dense=False,
        process_set=global_process_set,
    ):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        if op == Adasum:
            raise NotImplementedError("Adasum is not offered by plait.horovod; use op=hvd.Average or hvd.Sum")
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [
                (f"allreduce.noname.{i}.{j}", v)
                for i, group in enumerate(self.param_groups)
                for j, v in enumerate(group["params"])
            ]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError(
                "named_parameters should be a sequence of tuples (name, parameter), "
                "usually model.named_parameters()"
            )
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError(
                f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}"
            )
        all_ids = {id(v) for g in self.param_groups for v in g["params"]}
        named_ids = {id(v) for _, v in named_parameters}
        if named_parameters and all_ids - named_ids:
            raise ValueError(
                "named_parameters was specified, but one or more model parameters were not named"
            )
        self._parameter_names = {v: k for k, v in named_parameters}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for g in self.param_groups for v in g["params"]}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles = {}
        self._hooks = []
        self._synchronized = False
        self._should_synchronize = True
        self._groups = []
        self._group_of = {}
        self._group_ready = {}
        if groups is not None:
            if isinstance(groups, int):
                groups_list = self._split(groups)
            else:
                groups_list = [list(g) for g in groups]
            for gi, g in enumerate(groups_list):
                self._groups.append(g)
                for p in g:
                    self._group_of[p] = gi
        self._requires_update = set()
        self._register_hooks()

    def _split(self, n):
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if n <= 0:
            return []
        k, r = divmod(len(params), n)
        out, at = [], 0
        for i in range(n):
            m = k + (1 if i < r else 0)
            if m:
                out.append(params[at : at + m])
            at += m
        return out

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _register_hooks(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _scales(self):
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            p.grad = torch.zeros_like(p.data)
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if self.sparse_as_dense:
                tensor = p.grad = tensor.to_dense()
            else:
                return sparse_allreduce_async(
                    tensor, name=name, op=self.op, process_set=self.process_set
                ), "sparse"
        compressed, ctx = self._compression.compress(tensor)
        pre, post = self._scales()
        h = allreduce_async_(
            compressed,
            name=name,
            op=self.op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self.process_set,
        )
        return h, (compressed, ctx)

    def _grouped_allreduce_async(self, gi):
        ps = self._groups[gi]
        for p in ps:
            if p.grad is None:
                p.grad = torch.zeros_like(p.data)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        pairs = [self._compression.compress(p.grad) for p in ps]
        pre, post = self._scales()
        h = grouped_allreduce_async_(
            [c for c, _ in pairs],
            name=f"group.{gi}",
            op=self.op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self.process_set,
        )
        for p, pair in zip(ps, pairs):
            self._handles[p] = (h, pair, gi)

    def _make_hook(self, p):
        def hook(*ignore):
            if p in self._handles and self._handles[p][0] is not None:
                if self._allreduce_delay[p] <= 0:
                    raise AssertionError(
                        "Gradients were computed more than backward_passes_per_step times "
                        "before call to step(). "
                        "Increase backward_passes_per_step to accumulate gradients locally."
                    )
            assert not p.grad.requires_grad
            assert self._allreduce_delay[p] > 0
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] != 0:
                self._handles.setdefault(p, (None, None, None))
                return
            gi = self._group_of.get(p)
            if gi is None:
                h, ctx = self._allreduce_grad_async(p)
                self._handles[p] = (h, ctx, None)
                return
            ready = self._group_ready.setdefault(gi, set())
            ready.add(p)
            if len(ready) == len(self._groups[gi]):
                self._group_ready.pop(gi)
                self._grouped_allreduce_async(gi)

        return hook

    def synchronize(self):
        """Waits for every gradient's allreduce (submitting those whose hook has not run, e.g.
        parameters unused in this step) and writes the results into p.grad."""
        pending_groups = set(self._group_ready)
        for gi in sorted(pending_groups):
            self._group_ready.pop(gi, None)
            self._grouped_allreduce_async(gi)
        for p in sorted(
            self._requires_update - set(self._handles), key=lambda q: self._parameter_names.get(q, "")
        ):
            gi = self._group_of.get(p)
            if gi is not None:
                if p not in self._handles:
                    self._grouped_allreduce_async(gi)
                continue
            h, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (h, ctx, None)
        for p, (h, ctx, _) in list(self._handles.items()):
            if h is None:
                h, ctx = self._allreduce_grad_async(p)
                self._handles[p] = (h, ctx, None)
        done = {}
        for p, (h, ctx, _) in self._handles.items():
            if h not in done:
                done[h] = synchronize(h)
            if ctx == "sparse":
                p.grad = done[h]
            else:
                compressed, cctx = ctx
                out = self._compression.decompress(compressed, cctx)
                if out is not p.grad:
                    p.grad.copy_(out)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For when synchronize() was called by hand before step() (e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _plait_raw_step(self, closure=None):
        return super(self.__class__, self).step(closure)

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if any(h is not None for h, _, _ in self._handles.values()):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                "a race condition."
            )
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    compression=Compression.none,
    backward_passes_per_step=1,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    sparse_as_dense=False,
    process_set=global_process_set,
):
    """Wraps `optimizer` so that step() first averages (op) the gradients across the ranks of
    process_set. As Horovod's: compression, backward_passes_per_step (local accumulation),
    gradient_predivide_factor (divide before the sum, multiply after), num_groups / groups (one
    grouped allreduce per group of parameters), sparse_as_dense."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    if groups is not None:
        if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        if isinstance(groups, list):
            ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
            for g in groups:
                if not isinstance(g, list) or any(id(p) not in ids for p in g):
                    raise ValueError("groups must be lists of the optimizer's parameters")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
