"""The parts of the SSH backend, one concept each.

- :mod:`~orchestrate.backends.ssh.connections`: who a host is and how to reach it; opening
  connections with host keys checked; bounded parallel fan-out with a result or an error per
  host. The only module that touches Fabric/paramiko directly.
- :mod:`~orchestrate.backends.ssh.agent`: the standard-library program run on every host
  (preflight, leases, starting one rank, kill-by-tag).
- :mod:`~orchestrate.backends.ssh.channels`: one pty channel per rank speaking to the agent,
  and the :class:`~orchestrate.run.supervise.RankHandle` built on it.
- :mod:`~orchestrate.backends.ssh.preflight`: what to ask each host, how to judge the answers
  against the plan, and the per-host table of what failed.
- :mod:`~orchestrate.backends.ssh.launcher`: preflight, re-plan, lease, copy and start, over
  the same connections.
"""
