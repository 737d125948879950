"""Commands that launch and track jobs: submit, list, status, logs, cancel."""
