"""Framework-independent parts of plait.horovod (Horovod's horovod.common)."""
