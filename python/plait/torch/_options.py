"""pg_options for the "plait" backend."""


class Options:
    """pg_options for init_process_group / new_group with backend "plait".

    buffer_bytes: shared staging bytes per rank of the group's communicator (default
    PLAIT_BUFFER_BYTES, else 4 MiB).
    """

    def __init__(self, buffer_bytes=None):
        self.buffer_bytes = buffer_bytes
