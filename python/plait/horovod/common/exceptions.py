"""Horovod's exception classes (horovod.common.exceptions)."""


class HorovodInternalError(RuntimeError):
    """A collective failed on this rank: a mismatch between ranks, a lost peer, a deadline.

    plait.horovod raises it on every rank that took part, and hvd stays usable afterwards except
    when a plait collective failed (a lost peer, a deadline: then elastic training restores the
    last commit). `flight`: plait's flight recorder report (every rank's last calls) in that
    case, else None."""

    flight = None


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed; elastic training re-rendezvouses. skip_sync: the state was
    committed just before, so there is nothing to restore."""

    def __init__(self, skip_sync):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class HorovodVersionMismatchError(ImportError):
    """Kept for scripts that catch it; plait.horovod has no separately compiled extension."""

    def __init__(self, name, version, installed_version):
        super().__init__(f"{name} was built for Horovod {version}, found {installed_version}")
        self.name, self.version, self.installed_version = name, version, installed_version


def get_version_mismatch_message(name, version, installed_version):
    return f"Framework {name} installed with version {installed_version} but found version {version}."
