"""``orchestrate gpus``: every GPU of this machine (or of an inventory's SSH nodes) and who holds
it -- orchestrate jobs of every user, by lease, and compute processes outside orchestrate.

What a person on a shared server would otherwise piece together from ``nvidia-smi``, ``ps`` and
the lease book. Locally it reads them in this process; for ``--inventory`` each node's agent
answers over SSH (``agent gpus``), in parallel, each host bounded like any SSH step. Read-only:
it claims nothing and waits for nobody's lock longer than the book allows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from orchestrate.cli.tables import console
from orchestrate.core.errors import UserError


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--inventory", "inventory_file", type=click.Path(path_type=Path), default=None,
              help="the SSH nodes of this inventory instead of this machine")
def gpus(as_json: bool, inventory_file: Path | None) -> None:
    """Every GPU of this machine (or of an inventory's SSH nodes) with its model, memory
    used/total, utilization, health (pass, warn or fail) and holders: orchestrate jobs (user, job
    id, since) and processes outside orchestrate (pid, user, name, memory).

    Health is the GPU health check a submit makes (docs/doctor.md, "GPU health"); each GPU that
    is not healthy gets its sentence below the table.

    The model is named as a job's gpu_model names it (what inventory probe writes), with
    nvidia-smi's own name beside it."""
    hosts = [this_machine()] if inventory_file is None else over_ssh(inventory_file)
    hosts = [with_health(with_models(answer)) for answer in hosts]
    if as_json:
        click.echo(json.dumps(hosts[0] if inventory_file is None else hosts, indent=2))
        return
    for answer in hosts:
        show(answer)


def with_models(answer: dict[str, Any]) -> dict[str, Any]:
    """One host's answer with each GPU's ``model`` as a job's ``gpu_model:`` names it (what
    ``inventory probe`` writes: :func:`orchestrate.probe.facts.normalise_model`), beside
    ``name``, nvidia-smi's own."""
    from orchestrate.probe.facts import memory_gb, normalise_model

    def model(gpu: dict[str, Any]) -> str:
        mib = gpu.get("memory_total_mib")
        return normalise_model(str(gpu["name"]), memory_gb(mib) if mib else None)

    return {**answer, "gpus": [{"index": gpu["index"], "model": model(gpu), **gpu}
                               for gpu in answer["gpus"]]}


def with_health(answer: dict[str, Any]) -> dict[str, Any]:
    """One host's answer with each GPU's ``health`` (pass, warn or fail) and ``health_line``
    (the sentence: :mod:`orchestrate.core.gpuhealth`), from the health facts gathered beside
    it (``gpu_health``, dropped from the answer); what could not be checked joins
    ``problems``."""
    from orchestrate.core.gpuhealth import judge

    facts = answer.pop("gpu_health", None)
    if facts is None:
        return answer
    verdict = judge(facts)
    by_index = {g.index: g for g in verdict.gpus}
    gpus = []
    for gpu in answer["gpus"]:
        found = by_index.get(int(gpu["index"]))
        gpus.append({**gpu, "health": found.status if found else "?",
                     "health_line": found.line if found and found.findings else None})
    return {**answer, "gpus": gpus,
            "problems": [*(answer.get("problems") or []), *verdict.notes]}


def this_machine() -> dict[str, Any]:
    """This machine's GPUs, holders and health (what the SSH agent answers on a host)."""
    from orchestrate.hostside.gpuhealth import gather
    from orchestrate.hostside.leases import machine_gpus

    answer = machine_gpus(None)
    if answer["gpus"]:
        answer["gpu_health"] = gather()
    return answer


def over_ssh(inventory_file: Path) -> list[dict[str, Any]]:
    """Each SSH node of the inventory, asked through the agent, in inventory order."""
    from orchestrate.backends.ssh.probe import ask_agents
    from orchestrate.core.spec.inventory import load_inventory

    if not inventory_file.exists():
        raise UserError.single("inventory file not found", source=str(inventory_file),
                               field="--inventory")
    return [{**told.value, "node": told.node} if told.value is not None else
            {"host": told.host, "node": told.node, "gpus": [], "problems": [told.why]}
            for told in ask_agents(load_inventory(inventory_file).nodes, "gpus")]


def _holder(h: dict[str, Any]) -> str:
    if h["kind"] == "job":
        since = time.strftime(" since %H:%M:%S", time.localtime(h["since"])) if h["since"] \
            else ""
        left = "".join(f"; ended, still held by pid {s['pid']} ({s['user']}, {s['name']}) "
                       "that outlived SIGKILL" for s in h.get("survivors") or [])
        return f"job {h['job_id']} ({h['user']}{since}{left})"
    job = f", job {h['job_id']}" if h.get("job_id") else ""
    foreign = " -- another user's, on a leased GPU" if h.get("foreign") else ""
    return f"pid {h['pid']} ({h['user']}, {h['name']}, {h['memory_gb']:.1f} GB{job}){foreign}"


def show(answer: dict[str, Any]) -> None:
    """One host's GPUs as a table, then what could not be read."""
    from rich.table import Table

    out = console()
    table = Table(title=f"GPUs of {answer['host']}")
    for column in ("gpu", "model", "nvidia-smi name", "memory used/total", "util", "health",
                   "held by"):
        table.add_column(column)
    for gpu in answer["gpus"]:
        used = "?" if gpu["memory_used_gb"] is None else f"{gpu['memory_used_gb']:.1f}"
        util = "?" if gpu["utilization_pct"] is None else f"{gpu['utilization_pct']:.0f}%"
        holders = "\n".join(_holder(h) for h in gpu["holders"]) or "free"
        table.add_row(str(gpu["index"]), str(gpu["model"]), str(gpu["name"]),
                      f"{used} / {gpu['memory_total_gb']:.1f} GB", util,
                      str(gpu.get("health") or "?"), holders)
    if answer["gpus"]:
        out.print(table)
    else:
        out.print(f"{answer['host']}: no GPUs", markup=False)
    book = answer.get("book") or {}
    if book.get("trust"):
        out.print(f"{answer['host']}: lease book {book.get('path') or ''}: {book['trust']}",
                  markup=False, soft_wrap=True)
    for line in answer.get("queue") or []:
        out.print(f"{answer['host']}: waiting: {line}", markup=False, soft_wrap=True)
    for gpu in answer["gpus"]:
        if gpu.get("health_line"):
            out.print(f"{answer['host']}: {gpu['health']}: {gpu['health_line']}", markup=False,
                      soft_wrap=True)
    for problem in answer.get("problems") or []:
        out.print(f"{answer['host']}: {problem}", markup=False, soft_wrap=True)
