"""Makes `dist.init_process_group("plait")` work without `import plait.torch`.

torch (2.5 and later) calls every entry point of the group "torch.backends" at the end of its own
import (torch/__init__.py, `_import_device_backends`; TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns that
off). pyproject.toml names `register` below there. It runs inside `import torch` of every program
in the environment, so it stays cheap: it registers a creator and nothing else. The first
"plait" group calls that creator, which imports plait.torch (compiling the native backend the
first time) and hands over to its creator; plait.torch then replaces this registration with its
own. Any failure here is swallowed: torch turns an exception from an entry point into a failed
`import torch`, and a program that never uses plait must not pay for it.
"""

BACKEND = "plait"
# What plait.torch registers when its native backend loads; it re-registers with its own list.
DEVICES = ["cpu"]


def _create(opts, pg_options):
    from plait import torch as plait_torch

    return plait_torch._create(opts, pg_options)


def register():
    try:
        import torch.distributed as dist

        if not dist.is_available() or BACKEND.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=DEVICES)
    except Exception:  # noqa: BLE001 - never break `import torch` for programs that do not use plait
        pass
