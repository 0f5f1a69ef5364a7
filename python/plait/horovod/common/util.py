"""Helpers of horovod.common.util that scripts and integrations import."""

import os
from contextlib import contextmanager


def check_extension(ext_name, ext_env_var, pkg_path, *args):
    """Horovod checks that its compiled extension exists; plait.horovod has none to check."""


def extension_available(ext_base_name, verbose=False):
    return ext_base_name in ("horovod.torch", "plait.horovod.torch")


def gpu_available(ext_base_name, verbose=False):
    """False: plait.horovod runs its ops on CPU tensors (docs/horovod.md)."""
    return False


def split_list(items, n):
    """items cut into n contiguous parts whose lengths differ by at most one."""
    k, r = divmod(len(items), n)
    out, at = [], 0
    for i in range(n):
        m = k + (1 if i < r else 0)
        out.append(items[at : at + m])
        at += m
    return out


def is_iterable(x):
    try:
        iter(x)
    except TypeError:
        return False
    return True


def num_rank_is_power_2(num_rank):
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def get_average_backwards_compatibility_fun(reduce_ops):
    """fn(op, average) -> op: Horovod's handling of the deprecated `average` argument."""

    def impl(op, average):
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one of them.")
            return op
        if average is not None:
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average

    return impl


@contextmanager
def env(**kwargs):
    """Sets environment variables inside the block (None removes one), then restores them."""
    old = {k: os.environ.get(k) for k in kwargs}
    try:
        for k, v in kwargs.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
