"""The local backend: every rank a process on this machine, under a detached supervisor."""
