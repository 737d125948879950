"""The ``restart:`` section of a job file: when a job is started again, and after how long.

Its own module because the policy is a concept of its own (docs/restart.md): which endings
restart, the budget for the whole job, the waits between attempts, whether a failed node is
avoided. :mod:`orchestrate.core.plan.restart` turns it into the plan's ``Policy``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from orchestrate.core.spec.schema import Bool, Float, Int, Spec, not_boolean

RestartOn = Literal["failure", "stall", "node_lost", "requeue"]
#: Endings a restart policy may name, and what each means (docs/restart.md).
RESTART_ENDINGS: dict[str, str] = {
    "failure": "a rank died: a signal, or a non-zero exit other than a user error (2)",
    "stall": "the job was stopped after a stall diagnosis (distributed.on_stall: kill)",
    "node_lost": "a node stopped answering (an SSH host cut off, a Slurm node failure)",
    "requeue": "every rank that stopped checkpointed and asked to be started again (exit 75)",
}


#: One item of restart.on: an ending's name or an exit code (true/false refused before either).
RestartItem = Annotated[RestartOn | int, not_boolean("an ending name or an exit code")]


def _default_restart_on() -> list[RestartItem]:
    return ["requeue", "node_lost"]


#: The endings of a policy that writes ``max`` and no ``on``: a budget covers crashed ranks too.
BUDGET_RESTART_ON: tuple[RestartOn, ...] = ("requeue", "node_lost", "failure")


class RestartPolicy(Spec):
    """When a job is started again: same job id, run directory and checkpoints, on every
    backend. The budget is for the whole job (not per node); a user error is never restarted."""

    max: Int = Field(default=3, ge=0, description="restarts for the whole job")
    on: list[RestartItem] = Field(
        default_factory=_default_restart_on,
        description="which endings restart: failure, stall, node_lost, requeue, or exit codes; "
        "default [requeue, node_lost], or [requeue, node_lost, failure] when max is written",
    )
    backoff_s: list[Float] = Field(
        default_factory=lambda: [10.0, 60.0, 300.0],
        description="seconds to wait before restart 1, 2, ...; the last repeats")
    exclude_failed_node: Bool = Field(
        default=False, description="restart elsewhere: another inventory node (SSH), "
        "--exclude the node (Slurm)")

    @model_validator(mode="before")
    @classmethod
    def _budget_covers_failures(cls, data: Any) -> Any:
        """``max`` written without ``on`` restarts a crashed rank too, as torchrun's
        ``--max-restarts`` and SkyPilot's recovery do: a budget that never restarted a failure
        surprised everyone. Nothing written keeps ``[requeue, node_lost]`` (no work lost by
        restarting those), and an ``on`` that is written is honoured exactly."""
        if isinstance(data, dict) and "max" in data and "on" not in data:
            return {**data, "on": list(BUDGET_RESTART_ON)}
        return data

    @field_validator("on")
    @classmethod
    def _endings(cls, value: list[RestartItem]) -> list[RestartItem]:
        for item in value:
            if isinstance(item, int):
                if item == 2:
                    raise ValueError("exit code 2 is a user or configuration error: restarting "
                                     "it can only fail the same way")
                if not 1 <= item <= 255:
                    raise ValueError(f"an exit code is 1-255 (got {item})")
        return value

    @field_validator("backoff_s")
    @classmethod
    def _backoff(cls, value: list[float]) -> list[float]:
        if any(v < 0 for v in value):
            raise ValueError("waits are 0 seconds or more")
        return value
