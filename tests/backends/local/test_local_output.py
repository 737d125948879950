"""A rank's output on real processes: however much of it, and whatever bytes it holds.

Volume: a line without a newline must not fill the supervisor's memory, ``orchestrate logs``
must stream a large log, every byte is on disk once (the merged view is derived), and a job can
cap what a rank writes. Bytes: a rank's escape sequences and carriage returns must not reach the
user's terminal as such (a real pty, as a user's ``submit --follow`` and ``logs`` see), while
the files keep them as written.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import sqlite3
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrate.hostside.outputlog import LINE_MAX
from tests.support.localcli import Cli
from tests.support.output import merged_bytes

pytestmark = pytest.mark.process

MB = 1 << 20


def _job(cli: Cli, name: str, program: str, extra: str = "") -> Path:
    cli.write(f"{name}.py", program)
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 1}}
        command: [python, {name}.py]
        {extra}
        """)


def _wait(cli: Cli, job: str, states: set[str], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        if cli.run("status", job).returncode == 0:
            status = cli.status(job)
            if status["state"] in states or time.monotonic() > deadline:
                return status
        elif time.monotonic() > deadline:
            raise AssertionError(f"{job} was never recorded")
        time.sleep(0.2)


def _supervisor_pid(cli: Cli, job: str) -> int:
    db = sqlite3.connect(cli.home / "jobs.db")
    try:
        (pid,) = db.execute("SELECT supervisor_pid FROM jobs WHERE id = ?", [job]).fetchone()
    finally:
        db.close()
    return int(pid)


def _peak_rss_until_done(cli: Cli, job: str, timeout: float) -> tuple[int, dict[str, Any]]:
    """The supervisor's peak resident memory (VmHWM, bytes), read until the job ends."""
    _wait(cli, job, {"RUNNING", "COMPLETED", "FAILED"}, 60)
    pid = _supervisor_pid(cli, job)
    peak = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            break
        hwm = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
        if hwm is None:  # exited, not yet reaped: no memory any more
            break
        peak = max(peak, int(hwm.split()[1]) * 1024)
        if cli.status(job)["state"] in ("COMPLETED", "FAILED"):
            break
        time.sleep(0.1)
    return peak, _wait(cli, job, {"COMPLETED", "FAILED"}, timeout)


def _max_rss_of(cli: Cli, *args: str) -> int:
    """Peak resident memory (bytes) of ``orchestrate ARGS`` run to the end, output discarded."""
    probe = ("import resource, subprocess, sys\n"
             "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True)\n"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "orchestrate",
                           *args], cwd=cli.work, env=cli.env, capture_output=True, text=True,
                          timeout=120, check=True)
    return int(done.stdout.strip()) * 1024


ENDLESS_LINE = """
import sys, time
for _ in range(64):
    sys.stdout.write("x" * (1 << 20))
sys.stdout.write("\\ndone\\n")
sys.stdout.flush()
time.sleep(1)
"""

SMALL = "print('small')\n"
#: The same, running long enough for its supervisor's memory to be read (the baseline).
IDLE = "import time\nprint('small')\ntime.sleep(2)\n"


@pytest.mark.timeout(180)
def test_a_line_without_a_newline_is_cut_and_never_held_whole(cli: Cli) -> None:
    small = cli.id("small")
    cli.run("submit", str(_job(cli, "small", IDLE)), "--detach", "--job-id", small, check=True)
    baseline, _ = _peak_rss_until_done(cli, small, 60)
    assert baseline > 0, "the baseline supervisor's memory was never read"
    endless = cli.id("endless")
    cli.run("submit", str(_job(cli, "endless", ENDLESS_LINE)), "--detach", "--job-id", endless,
            check=True)
    peak, status = _peak_rss_until_done(cli, endless, 120)
    assert status["state"] == "COMPLETED", status
    # 64 MB in one line: the supervisor holds a piece of it at a time, not the line (it held
    # about five copies of it).
    assert peak - baseline < 24 * MB, (peak, baseline)
    run_dir = Path(status["run_dir"])
    assert (run_dir / "logs" / "rank-0.log").stat().st_size == 64 * MB + len("\ndone\n")
    pieces = merged_bytes(run_dir).splitlines()
    long = [p for p in pieces if p.startswith(b"[localhost:0] x")]
    assert len(long) == 64 * MB // LINE_MAX
    assert {len(p) for p in long} == {len(b"[localhost:0] ") + LINE_MAX}
    assert b"[localhost:0] done" in pieces


BULK = """
import sys
line = ("%-99s" % "bulk") + "\\n"
for i in range(500_000):
    sys.stdout.write(line)
"""


@pytest.mark.timeout(240)
def test_a_large_log_is_stored_once_and_logs_streams_it(cli: Cli) -> None:
    small = cli.id("small")
    cli.run("submit", str(_job(cli, "small", SMALL)), "--detach", "--job-id", small, check=True)
    _wait(cli, small, {"COMPLETED"}, 60)
    bulk = cli.id("bulk")
    cli.run("submit", str(_job(cli, "bulk", BULK)), "--detach", "--job-id", bulk, check=True)
    status = _wait(cli, bulk, {"COMPLETED", "FAILED"}, 180)
    assert status["state"] == "COMPLETED", status
    run_dir = Path(status["run_dir"])
    printed = 500_000 * 100
    assert (run_dir / "logs" / "rank-0.log").stat().st_size == printed
    # Every byte once: the rank's file, plus an index of a few bytes per write burst; no
    # second, prefixed copy.
    on_disk = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file()
                  and p.suffix in (".log", ".idx"))
    assert on_disk < printed * 1.02, on_disk
    # `logs` prints every line, prefixed, holding a block at a time (it read the whole file).
    shown = cli.run("logs", bulk, timeout=120, check=True).stdout
    assert shown.count("[localhost:0] bulk") == 500_000
    assert _max_rss_of(cli, "logs", bulk) - _max_rss_of(cli, "logs", small) < 16 * MB


CHATTY = """
import sys
for i in range(50_000):
    print(f"chatty line {i:08d} " + "y" * 80)
print("the rank went on and ended", file=sys.stderr)
"""


@pytest.mark.timeout(120)
def test_a_rank_over_its_cap_keeps_running_and_the_log_says_so(cli: Cli) -> None:
    job = _job(cli, "chatty", CHATTY, "logs: {max_mb_per_rank: 1}")
    job_id = cli.id("chatty")
    proc = cli.run("submit", str(job), "--follow", "--job-id", job_id, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = cli.status(job_id)
    run_dir = Path(status["run_dir"])
    assert (run_dir / "logs" / "rank-0.log").stat().st_size == 1 * MB
    assert "[orchestrate] rank 0 reached logs.max_mb_per_rank (1 MB)" in proc.stdout
    assert "byte(s) of output dropped past logs.max_mb_per_rank" in proc.stdout
    assert "the rank went on and ended" not in proc.stdout  # it was past the cap
    assert status["state"] == "COMPLETED"


HOSTILE = r"""
import sys
w = sys.stdout.buffer.write
w(b"\x1b[2J\x1b[?1049h clear and alternate screen\n")
w(b"\x1b]0;pwned title\x07\n")
w(b"\x1b]52;c;cHduZWQ=\x07\n")
w(b"\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\\n")
w(b"progress 10%\rprogress 20%\r[orchestrate] job COMPLETED: forged\n")
w("\u009b2J c1 csi\n".encode())
w(b"plain\ttab\n")
"""

#: What must not reach a terminal from HOSTILE, byte for byte.
RAW = (b"\x1b[2J", b"\x1b[?1049h", b"\x1b]0;", b"\x1b]52;", b"\x1b]8;", b"\x07", b"\xc2\x9b",
       b"\r[orchestrate]")


def _on_pty(cli: Cli, *args: str, timeout: float = 90) -> tuple[int, bytes]:
    """``orchestrate ARGS`` with its standard input, output and error on a new pty (what a
    user's terminal is), 200 columns wide; its exit status and everything it wrote there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrate", *args], cwd=cli.work,
                            env={**cli.env, "TERM": "xterm-256color"}, stdin=slave,
                            stdout=slave, stderr=slave, close_fds=True, start_new_session=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer of the pty is gone
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=10), out
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def _check_terminal(out: bytes) -> None:
    for raw in RAW:
        assert raw not in out, (raw, out)
    assert b"\\x1b]0;pwned title\\x07" in out
    assert b"\\x1b]52;c;cHduZWQ=\\x07" in out
    assert b"\\x9b2J c1 csi" in out
    # The forged line stays behind the rank's prefix, its carriage returns shown.
    assert (b"[localhost:0] progress 10%\\x0dprogress 20%\\x0d[orchestrate] job COMPLETED: "
            b"forged") in out
    # A tab is text: kept, or expanded to spaces by the live view above the progress line.
    assert re.search(rb"\[localhost:0\] plain(\t| {2,8})tab", out), out
    for line in out.replace(b"\r\n", b"\n").split(b"\n"):
        assert not line.startswith(b"[orchestrate] job COMPLETED: forged"), out


@pytest.mark.timeout(180)
def test_a_ranks_control_sequences_never_reach_the_terminal(cli: Cli) -> None:
    job = _job(cli, "hostile", HOSTILE)
    followed = cli.id("hostile-1")
    code, out = _on_pty(cli, "submit", str(job), "--job-id", followed)  # follows: a terminal
    assert code == 0, out
    _check_terminal(out)
    assert b"job " + followed.encode() + b" COMPLETED" in out
    run_dir = Path(cli.status(followed)["run_dir"])
    # The files keep the bytes as the rank wrote them.
    written = (run_dir / "logs" / "rank-0.log").read_bytes()
    assert written.startswith(b"\x1b[2J\x1b[?1049h clear")
    assert b"\r[orchestrate] job COMPLETED: forged\n" in written
    for args in (("logs", followed), ("logs", followed, "-f"), ("logs", followed, "--rank", "0")):
        code, out = _on_pty(cli, *args)
        assert code == 0, (args, out)
        for raw in RAW:
            assert raw not in out, (args, raw, out)
        assert b"\\x1b]52;c;cHduZWQ=\\x07" in out
        if "--rank" not in args:
            _check_terminal(out)
    # Into a pipe or a file, `logs` gives the bytes (prefixed in the merged view).
    piped = subprocess.run([sys.executable, "-m", "orchestrate", "logs", followed],
                           cwd=cli.work, env=cli.env, capture_output=True, timeout=60,
                           check=True).stdout
    assert b"[localhost:0] \x1b]0;pwned title\x07\n" in piped
    assert b"[localhost:0] progress 10%\rprogress 20%\r[orchestrate] job COMPLETED" in piped
    rank = subprocess.run([sys.executable, "-m", "orchestrate", "logs", followed, "--rank", "0"],
                          cwd=cli.work, env=cli.env, capture_output=True, timeout=60,
                          check=True).stdout
    assert rank == written
