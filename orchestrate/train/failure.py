"""The one exception type of a failed rank, carrying the line a person should read.

Under DDP the first error is easily buried: the other ranks report "connection closed" a moment
later. So a rank's own failure (a factory that raised, a checkpoint that does not fit) becomes a
:class:`TrainFailure` whose message is one line, printed as ``rank N: <message>``.
"""


class TrainFailure(Exception):
    """This rank cannot go on; ``str(exc)`` is the line to print after ``rank N:``."""
