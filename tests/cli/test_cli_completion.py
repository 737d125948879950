"""Shell completion through click's protocol (``_ORCHESTRATE_COMPLETE``), as bash, zsh and fish
call it: commands, and job ids and names from the job store for the commands that take a job."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.localcli import Cli

pytestmark = pytest.mark.process


def _complete(cli: Cli, shell: str, words: str) -> list[str]:
    """What the shell's completion function gets for the command line ``words`` (the cursor
    at its end): bash and zsh pass the index of the word being completed, fish the word."""
    cword = words.split(" ")[-1] if shell == "fish" else str(len(words.split(" ")) - 1)
    env = {"_ORCHESTRATE_COMPLETE": f"{shell}_complete", "COMP_WORDS": words,
           "COMP_CWORD": cword}
    done = replace(cli, env={**cli.env, **env}).run()
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return [line for line in done.stdout.splitlines() if line]


def test_job_taking_commands_complete_ids_and_names(cli: Cli) -> None:
    ended = cli.write("quick.yaml", """
        name: quickjob
        resources: {nodes: 1, gpus_per_node: 1}
        command: [bash, -c, 'true']
        """)
    running = cli.write("long.yaml", f"""
        name: longjob
        resources: {{nodes: 1, gpus_per_node: 1}}
        env: {{DONE: '{cli.work / "long.done"}'}}
        command: [bash, -c, 'while [ ! -e "$DONE" ]; do sleep 0.2; done']
        """)
    first = cli.id("a1")
    cli.run("submit", str(ended), "--follow", "--job-id", first, check=True)
    second = cli.id("b2")
    cli.run("submit", str(running), "--detach", "--job-id", second, check=True)
    try:
        assert _complete(cli, "bash", "orchestrate logs quick") == ["plain,quickjob"]
        assert _complete(cli, "bash", "orchestrate status ") == [
            f"plain,{second}", "plain,longjob", f"plain,{first}", "plain,quickjob"]
        assert _complete(cli, "bash", f"orchestrate report {first[:7]}") == [f"plain,{first}"]
        # cancel is offered what still runs; zsh shows each one's state
        assert _complete(cli, "bash", "orchestrate cancel ") == [f"plain,{second}",
                                                                  "plain,longjob"]
        zsh = _complete(cli, "zsh", "orchestrate logs long")
        assert zsh[:3] == ["plain", "longjob", f"latest: {second} RUNNING"], zsh
        fish = _complete(cli, "fish", "orchestrate diagnose long")
        assert fish == [f"plain,longjob\tlatest: {second} RUNNING"], fish
        assert "plain,logs" in _complete(cli, "bash", "orchestrate lo")
    finally:
        (cli.work / "long.done").write_text("")
        cli.run("cancel", second)


def test_completion_without_a_job_store_completes_nothing_quietly(cli: Cli) -> None:
    cli.env["ORCHESTRATE_HOME"] = str(cli.work / "no" / "such")
    assert _complete(cli, "bash", "orchestrate logs x") == []


def test_the_completion_script_is_click_s(cli: Cli) -> None:
    for shell, marker in (("bash", "complete -o nosort -F _orchestrate_completion orchestrate"),
                          ("zsh", "compdef _orchestrate_completion orchestrate"),
                          ("fish", "complete --no-files --command orchestrate")):
        done = replace(cli, env={**cli.env, "_ORCHESTRATE_COMPLETE": f"{shell}_source"}).run()
        assert marker in done.stdout, done.stdout
