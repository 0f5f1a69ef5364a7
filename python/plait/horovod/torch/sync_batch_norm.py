"""horovod.torch.sync_batch_norm: batch normalisation with statistics over all ranks of a set."""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..common.process_sets import global_process_set
from .mpi_ops import Sum, allreduce, size


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics (mean, variance) are those of the whole global batch:
    the per-channel sums, sums of squares and counts are allreduced in one op, as are the two
    per-channel gradient sums in backward. In eval mode, or alone, it is plain batch_norm."""

    def __init__(
        self,
        num_features,
        eps=1e-5,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
        process_set=global_process_set,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _run_bn(self, input, running_mean, running_var, momentum):
        return F.batch_norm(
            input,
            running_mean,
            running_var,
            self.weight,
            self.bias,
            self.training or not self.track_running_stats,
            momentum,
            self.eps,
        )

    def forward(self, input):
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        if not self.training or size() == 1 or (self.process_set.size() or size()) == 1:
            return self._run_bn(input, self.running_mean, self.running_var, momentum)
        return _SyncBatchNorm.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.eps,
            momentum,
            self.process_set,
        )


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        c = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        xs = x.detach()
        local = torch.cat(
            [xs.sum(dims), (xs * xs).sum(dims), torch.tensor([xs.numel() // c], dtype=xs.dtype)]
        )
        stats = allreduce(local, op=Sum, name=None, process_set=process_set)
        n = float(stats[-1])
        mean = stats[:c] / n
        var = stats[c : 2 * c] / n - mean * mean
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * n / max(n - 1, 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, c] + [1] * (x.dim() - 2)
        xhat = (xs - mean.view(shape)) * invstd.view(shape)
        y = xhat * weight.view(shape) + bias.view(shape) if weight is not None else xhat
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.n, ctx.ps, ctx.dims, ctx.shape = n, process_set, dims, shape
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, invstd, weight = ctx.saved_tensors
        dims, shape, c = ctx.dims, ctx.shape, xhat.shape[1]
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_weight = sum_dy_xhat if weight is not None else None
        grad_bias = sum_dy if weight is not None else None
        both = allreduce(torch.cat([sum_dy, sum_dy_xhat]), op=Sum, process_set=ctx.ps)
        g_dy, g_dy_xhat = both[:c], both[c:]
        w = weight.view(shape) if weight is not None else 1.0
        dx = (
            (dy - (g_dy / ctx.n).view(shape) - xhat * (g_dy_xhat / ctx.n).view(shape))
            * invstd.view(shape)
            * w
        )
        return dx, grad_weight, grad_bias, None, None, None, None, None
