"""Progress on the steps that take seconds: on a terminal a live line says which phase runs and
on which host (rich's status, on standard error); on a pipe nothing extra is written.

The phases come from below the CLI (``run/prepare``, the supervisors through their handshake
pipe, the doctor, the SSH probe) through :mod:`orchestrate.run.progress`; the process tests run
the real CLI on a pseudo-terminal (tests/support/terminals.py) and on pipes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from orchestrate.backends.handshake import Verdict, read_verdict
from orchestrate.doctor.run import tier_phase
from orchestrate.run.progress import HostCount, hosts, reporting, show
from tests.support.localcli import Cli
from tests.support.terminals import Terminal

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits" / "job.yaml"
#: A phase as the status line draws it: words, then "..." (the host in parentheses).
PHASE = re.compile(r"([a-z][\w' ;:,-]*(?: \([^)]*\))?)\.\.\.")


@pytest.mark.unit
def test_phases_reach_whoever_shows_them_and_nobody_else() -> None:
    seen: list[tuple[str, str | None]] = []
    show("nobody listens")  # costs a call, shows nothing
    with reporting(lambda phase, host=None: seen.append((phase, host))):
        show("copying the job's files", "gpu01")
        with reporting(lambda phase, host=None: None):
            show("inner")
        show("starting")
    show("after")
    assert seen == [("copying the job's files", "gpu01"), ("starting", None)]
    assert hosts(["a", "b"]) == "a, b"
    assert hosts([f"gpu{i:02d}" for i in range(16)]) == "gpu00, gpu01, gpu02 and 13 more"


@pytest.mark.unit
def test_a_phase_over_many_hosts_counts_them_as_each_is_done() -> None:
    """``inventory probe`` over 16 hosts: ``gathering facts 3/16 hosts (waiting for ...)``,
    counted from the SSH fan-out's threads, a host that failed counted too."""
    from concurrent.futures import ThreadPoolExecutor

    seen: list[tuple[str, str | None]] = []
    names = [f"gpu{i:02d}" for i in range(16)]

    def work(name: str) -> str:
        if name == "gpu05":
            raise OSError("no route to host")
        return name

    with reporting(lambda phase, host=None: seen.append((phase, host))):
        count = HostCount("gathering facts", names)
        with ThreadPoolExecutor(4) as pool:
            results = [pool.submit(count.counted(str, work), n) for n in names]
        assert sum(1 for r in results if r.exception() is not None) == 1
    assert seen[0] == ("gathering facts 0/16 hosts",
                       "waiting for gpu00, gpu01, gpu02 and 13 more")
    assert [phase for phase, _ in seen] == [f"gathering facts {n}/16 hosts" for n in range(17)]
    assert seen[-1][1] is None  # nobody left to wait for


@pytest.mark.unit
def test_the_doctors_phase_is_the_tier_it_is_in_and_where() -> None:
    tiers = ("static", "connect", "smoke")
    assert tier_phase(tiers, ["a", "b"], []) == ("doctor: static and connect tiers", "a, b")
    assert tier_phase(tiers, ["a", "b"], ["a"]) == ("doctor: static and connect tiers", "b")
    assert tier_phase(tiers, ["a", "b"], ["a", "b"]) == ("doctor: smoke tier", "a, b")
    assert tier_phase(("static",), ["a"], ["a"]) == ("doctor: grading", None)


@pytest.mark.unit
def test_submit_shows_the_supervisors_progress_lines_before_its_verdict() -> None:
    read, write = os.pipe()
    lines = [{"progress": "preflight", "host": "h1"}, {"progress": "claiming", "host": None},
             Verdict(ok=True).to_json()]
    os.write(write, "".join(__import__("json").dumps(line) + "\n" for line in lines).encode())
    os.close(write)
    seen: list[tuple[str, str | None]] = []
    with os.fdopen(read, "rb") as stream, \
            reporting(lambda phase, host=None: seen.append((phase, host))):
        verdict = read_verdict(stream, timeout=5)
    assert verdict is not None and verdict.ok
    assert seen == [("preflight", "h1"), ("claiming", None)]


ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _phases(text: str) -> list[str]:
    """The phases drawn, in order, once each."""
    return list(dict.fromkeys(m.group(1) for m in PHASE.finditer(ESCAPE.sub("", text))))


@pytest.mark.process
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_plan_shows_the_memory_trace_on_a_terminal_and_nothing_on_a_pipe(cli: Cli) -> None:
    args = ("plan", str(DIGITS), "--set", "train.strategy=auto")  # auto: the model is traced
    terminal = Terminal.orchestrate(*args, cwd=cli.work, env=cli.env)
    try:
        assert terminal.wait(timeout=180) == 0, terminal.text()
        phases = _phases(terminal.text())
    finally:
        terminal.close()
    assert phases[:2] == ["planning", "tracing the model's memory (a child process, up to a "
                                      "minute)"], phases
    piped = cli.run(*args, timeout=180)
    assert piped.returncode == 0, piped.stderr
    assert _phases(piped.stderr) == [] and "\x1b" not in piped.stderr + piped.stdout
    assert "rank" in piped.stdout  # the plan itself, as before


@pytest.mark.process
@pytest.mark.timeout(240)
def test_submit_shows_each_phase_on_a_terminal_and_nothing_on_a_pipe(cli: Cli) -> None:
    job = cli.write("quick.yaml", """
        name: quick
        resources: {nodes: 1, gpus_per_node: 2}
        command: [bash, -c, 'echo "hello from $RANK"']
        """)
    terminal = Terminal.orchestrate("submit", str(job), "--follow", "--job-id", cli.id("t"),
                                    cwd=cli.work, env=cli.env)
    try:
        assert terminal.wait(timeout=180) == 0, terminal.text()
        text = terminal.text()
    finally:
        terminal.close()
    phases = _phases(text)
    assert phases[:5] == ["planning", "starting the job's supervisor",
                          "claiming what the plan needs", "copying the job's files",
                          "starting the ranks; waiting for their first lines"], text
    assert phases[5:] in ([], ["running"]), text  # once a line came, if the job still ran
    assert "hello from 1" in text
    piped = cli.run("submit", str(job), "--follow", "--job-id", cli.id("p"), timeout=180)
    assert piped.returncode == 0, piped.stderr
    assert _phases(piped.stderr) == [] and "\x1b" not in piped.stderr + piped.stdout
    assert "hello from 1" in piped.stdout
