"""The controller's side of a job, shared by every backend.

:mod:`.prepare` loads once and plans (pure), :mod:`.store` records jobs, :mod:`.supervise` is
the loop that watches ranks on local and SSH, and :mod:`.logsink` writes their output.
"""
