"""What the tests of the real test clusters share (tests/clusters/*.sh, brought up by
tests/support/slurmcluster.py and tests/support/sshhosts.py)."""

from __future__ import annotations

#: Seconds a test's timeout allows on top of its own work for the cluster's bring-up:
#: pytest-timeout charges fixture setup to the first test that needs it, which pays for
#: ``slurm.sh up`` (on a fresh machine with apt-get install: seconds on a near mirror, a minute
#: or more on a far one); the others find the cluster up.
BRING_UP = 180
