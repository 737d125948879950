"""Exit statuses that mean something to orchestrate, in one place.

The rank entrypoint returns them, the batch script and the supervisors read them, the CLI exits
with some of them. Standard library only (no imports at all): the host-side programs that are
shipped to nodes as source text bundle this module too.
"""

#: Everything went as asked.
EXIT_OK = 0
#: Something failed at run time (a rank died, a job failed).
EXIT_FAILED = 1
#: A user mistake (a file, a field, the command line, the environment); like usage errors in
#: most Unix tools. Never worth restarting.
EXIT_USER_ERROR = 2
#: A rank checkpointed because it was asked to stop (SIGTERM/SIGUSR2 before a time limit or a
#: preemption) and asks to be started again: EX_TEMPFAIL from sysexits.h, "try again later".
EXIT_REQUEUE = 75
#: The CLI (``submit``, ``resume``): the job would fit, but GPUs, CPU slots or the master port
#: it needs are held by other jobs now. The file is fine; try again later. EX_TEMPFAIL, as
#: :data:`EXIT_REQUEUE` (a rank's "start me again later"); a request that can never fit is
#: :data:`EXIT_USER_ERROR`.
EXIT_BUSY = 75
#: The CLI: the machine is set up so that orchestrate cannot safely run there (a lease book
#: another user could subvert, one nobody can write): not the user's mistake, and waiting
#: will not help; whoever runs the machine fixes it once (the message says how). EX_CONFIG from
#: sysexits.h, "something was found in an unconfigured or misconfigured state".
EXIT_SETUP = 78
#: A Slurm job whose own GPU health check (its first step) found a GPU that must not be used:
#: the ranks never started. EX_UNAVAILABLE from sysexits.h; not a failure of the program, and
#: not worth a restart on the same node (orchestrate/backends/slurm/healthstep.py).
EXIT_UNHEALTHY = 69
#: Interrupted by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
#: A rank whose channel ended without a word about how it ended (an SSH connection lost): what
#: ``ssh`` itself reports for that.
EXIT_LOST = 255
