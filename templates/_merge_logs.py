"""Merge the per-rank log files of a Slurm job into one log with [host:rank] prefixes.

job.sbatch runs this (with the first node's python, standard library only) in the batch shell
while the ranks run: srun writes each rank's output straight to logs/rank-R.log, and this
single writer appends every complete line to output.log, so a line is never split or interleaved
with another rank's, even on NFS, where appends from several hosts are not atomic. A line without
its newline waits for the rest. SIGTERM means: one last pass, then exit.

How far each rank file has been merged is kept in OFFSETS (after every write): a requeued job
appends to the same rank files, and its next run goes on from there, so no line is merged twice
and none is lost, not even the last lines of a run whose batch host died.

    python _merge_logs.py MERGED_LOG LOG_DIR HOSTFILE OFFSETS [READY]
    (HOSTFILE: each rank's host, one a line; OFFSETS: a JSON list, written by this program;
    READY: created once SIGTERM is handled, so that the batch script never stops the merger
    before it can do its last pass)
"""

import json
import os
import signal
import sys
import time

LONGEST = 1 << 16  # a "line" this long without a newline is written as it is


def main(argv):
    merged, log_dir, hostfile, offsets_file = argv[1], argv[2], argv[3], argv[4]
    with open(hostfile, encoding="utf-8") as f:
        hosts = [line.strip() for line in f if line.strip()]
    paths = [os.path.join(log_dir, f"rank-{r}.log") for r in range(len(hosts))]
    prefixes = [f"[{host}:{r}] ".encode() for r, host in enumerate(hosts)]
    offsets = _load_offsets(offsets_file, len(paths))
    partial = [b""] * len(paths)
    state = {"stop": False, "sleeping": False}

    def on_signal(*_):
        state["stop"] = True
        if state["sleeping"]:  # cut the sleep short: the job is over, write the rest now
            raise _Wake

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if len(argv) > 5:
        with open(argv[5], "w"):
            pass
    out = open(merged, "ab")  # noqa: SIM115
    idle = 0.05
    while True:
        last = state["stop"]
        lines = []
        for r, path in enumerate(paths):
            size = _size(path)
            if size < offsets[r]:  # truncated by someone: start again
                offsets[r] = 0
            if size == offsets[r]:
                continue
            with open(path, "rb") as f:
                f.seek(offsets[r])
                data = f.read(size - offsets[r])
            offsets[r] += len(data)
            pieces = (partial[r] + data).split(b"\n")
            partial[r] = pieces.pop()
            if len(partial[r]) > LONGEST:
                pieces.append(partial[r])
                partial[r] = b""
            lines.extend(prefixes[r] + piece + b"\n" for piece in pieces)
        if last:
            lines.extend(prefixes[r] + rest + b"\n" for r, rest in enumerate(partial) if rest)
        if lines:
            out.write(b"".join(lines))
            out.flush()
            done = [offsets[r] - (0 if last else len(partial[r])) for r in range(len(paths))]
            _save_offsets(offsets_file, done)
            idle = 0.05
        else:
            idle = min(idle * 1.5, 0.5)
        if last:
            out.close()
            return 0
        try:
            state["sleeping"] = True
            if not state["stop"]:
                time.sleep(idle)
        except _Wake:
            pass
        finally:
            state["sleeping"] = False


class _Wake(Exception):
    pass


def _load_offsets(path, count):
    try:
        with open(path, encoding="utf-8") as f:
            saved = [int(x) for x in json.load(f)]
    except (OSError, ValueError, TypeError):
        saved = []
    return (saved + [0] * count)[:count]


def _save_offsets(path, offsets):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(offsets, f)
    os.replace(path + ".tmp", path)


def _size(path):
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
