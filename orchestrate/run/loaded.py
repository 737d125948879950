"""What ``submit`` loaded and planned, as values that cross to the supervisor: no spec models.

Why its own module: the spec models (pydantic, :mod:`orchestrate.core.spec`) are the slowest
import a supervisor has (0.1-0.2 s of CPU), and a local supervisor started before planning
(:mod:`orchestrate.backends.early`) is on the path from ``submit`` to the first rank. So
:class:`Loaded` imports them only to decode itself (:meth:`Loaded.from_json`);
:class:`Prepared` can be made from the handshake's JSON and decodes it on first use; and what
a claim reads of the job (lease book, GPUs, what it wants, how long it waits) comes computed
by the CLI, which has the job decoded anyway (:class:`ClaimFacts`). A job launched as planned
never decodes it in its supervisor; a re-plan, a restart that needs the job, or a backend that
reads more of it does, and gets the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.core.plan.memory import ModelFacts

if TYPE_CHECKING:
    from orchestrate.core.plan.plan import Plan
    from orchestrate.core.spec.inventory import Inventory, InventorySpec
    from orchestrate.core.spec.job import JobSpec


@dataclass(frozen=True)
class Loaded:
    """A job and everything read or measured for it, ready to be planned (any number of times).

    ``inventory_source`` is "" for a local job without an inventory file (this machine, probed
    into a spec). :meth:`to_json` / :meth:`from_json` carry it to a supervisor process, or to a
    later ``resume`` (``loaded.json`` in the run directory), without reading a file again.
    """

    source: str  # what errors name: the job file, or "<JobSpec>"
    overrides: tuple[str, ...]
    job: JobSpec
    inventory: Inventory
    inventory_spec: InventorySpec
    inventory_source: str
    workdir: Path
    runs: Path  # where run directories go
    templates_dir: Path | None
    param_count: float | None
    notes: tuple[str, ...] = ()
    debug: bool = False  # submit --debug: NCCL's log and torch's collective checks
    model: ModelFacts | None = None  # the model probe's facts and traces (train/modelfacts.py)
    fsdp_signs: tuple[str, ...] = ()  # framework-level FSDP in a command:'s files (programtext)

    @property
    def path(self) -> Path:
        """The job file (for messages)."""
        return Path(self.source)

    def run_dir(self, job_id: str) -> Path:
        """The run directory of ``job_id``."""
        return self.runs / job_id

    def to_json(self) -> dict[str, Any]:
        """Everything :meth:`from_json` needs, as JSON values."""
        return {
            "source": self.source,
            "overrides": list(self.overrides),
            "job": self.job.model_dump(mode="json", exclude_unset=True),  # as written: a
            # default dumped would read back as given (batch_size beside global_batch_size)
            "inventory": self.inventory_spec.model_dump(mode="json", exclude_unset=True),
            "inventory_source": self.inventory_source,
            "workdir": str(self.workdir),
            "runs": str(self.runs),
            "templates_dir": None if self.templates_dir is None else str(self.templates_dir),
            "param_count": self.param_count,
            "notes": list(self.notes),
            "debug": self.debug,
            "model": None if self.model is None else self.model.to_json(),
            "fsdp_signs": list(self.fsdp_signs),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Loaded:
        """The inverse of :meth:`to_json` (pure: validates and resolves again, reads nothing)."""
        from orchestrate.core.spec.inventory import InventorySpec, resolve_inventory
        from orchestrate.core.spec.job import JobSpec

        spec = InventorySpec.model_validate(data["inventory"])
        return cls(
            source=data["source"],
            overrides=tuple(data["overrides"]),
            job=JobSpec.model_validate(data["job"]),
            inventory=resolve_inventory(spec, data["inventory_source"]),
            inventory_spec=spec,
            inventory_source=data["inventory_source"],
            workdir=Path(data["workdir"]),
            runs=Path(data["runs"]),
            templates_dir=None if data["templates_dir"] is None else Path(data["templates_dir"]),
            param_count=data["param_count"],
            notes=tuple(data["notes"]),
            debug=bool(data.get("debug", False)),
            model=None if data.get("model") is None else ModelFacts.from_json(data["model"]),
            fsdp_signs=tuple(data.get("fsdp_signs", ())),
        )


@dataclass(frozen=True)
class NodeClaim:
    """What a claim on one node reads of the loaded job: the inventory's ``lease_dir``, whether
    the node is a GPU node and its GPUs' indices, and what the job wants there were nothing
    held (``backends.sharing.wants``: ``{"gpus": [...], "slots": n, "port": p or None}``)."""

    lease_dir: str | None
    is_gpu: bool
    gpus: tuple[int, ...]
    wants: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"lease_dir": self.lease_dir, "is_gpu": self.is_gpu, "gpus": list(self.gpus),
                "wants": dict(self.wants)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeClaim:
        lease_dir = data["lease_dir"]
        return cls(lease_dir=None if lease_dir is None else str(lease_dir),
                   is_gpu=bool(data["is_gpu"]), gpus=tuple(int(g) for g in data["gpus"]),
                   wants=dict(data["wants"]))


@dataclass(frozen=True)
class ClaimFacts:
    """What claiming the submitted plan reads of the loaded job, computed where it was loaded
    (``backends.sharing.claim_facts``): ``resources.wait`` in seconds (None: it does not wait)
    and each node of that plan by name. True of that plan only: a re-plan carries none."""

    wait_s: float | None
    nodes: Mapping[str, NodeClaim]

    def to_json(self) -> dict[str, Any]:
        return {"wait_s": self.wait_s,
                "nodes": {name: node.to_json() for name, node in self.nodes.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClaimFacts:
        wait_s = data["wait_s"]
        return cls(wait_s=None if wait_s is None else float(wait_s),
                   nodes={str(k): NodeClaim.from_json(v) for k, v in data["nodes"].items()})


class Prepared:
    """A job made ready to launch: what was loaded, and its plan (whose files its backend
    renders: ``Backend.files``). Made from a :class:`Loaded`, or from its JSON (a supervisor's
    handshake), which :attr:`loaded` decodes on first use; ``facts``, when given, are what a
    claim of this plan reads of it (:class:`ClaimFacts`)."""

    __slots__ = ("_json", "_loaded", "facts", "plan")

    def __init__(self, loaded: Loaded | Mapping[str, Any], plan: Plan,
                 facts: ClaimFacts | None = None) -> None:
        self._loaded: Loaded | None = loaded if isinstance(loaded, Loaded) else None
        self._json: dict[str, Any] | None = None if isinstance(loaded, Loaded) else dict(loaded)
        self.plan = plan
        self.facts = facts

    def __repr__(self) -> str:
        return f"Prepared(plan={self.plan.job_id!r}, decoded={self.decoded})"

    @property
    def loaded(self) -> Loaded:
        """What was loaded (decoded from the JSON it was made from, once)."""
        if self._loaded is None:
            assert self._json is not None
            self._loaded = Loaded.from_json(self._json)
        return self._loaded

    @property
    def decoded(self) -> bool:
        """Whether :attr:`loaded` is a value yet (the spec models in use)."""
        return self._loaded is not None

    def loaded_json(self) -> dict[str, Any]:
        """:meth:`Loaded.to_json` of :attr:`loaded`, without decoding what came as JSON."""
        return dict(self._json) if self._json is not None else self.loaded.to_json()

    def with_plan(self, plan: Plan) -> Prepared:
        """The same job with another plan (its claim facts, true of this plan only, dropped)."""
        return Prepared(self._loaded if self._loaded is not None else self.loaded_json(), plan)

    @property
    def path(self) -> Path:
        """The job file."""
        return Path(self._json["source"]) if self._json is not None else self.loaded.path

    @property
    def job(self) -> JobSpec:
        """The job spec."""
        return self.loaded.job

    @property
    def inventory(self) -> Inventory:
        """The resolved inventory."""
        return self.loaded.inventory

    @property
    def templates_dir(self) -> Path | None:
        """The job's own templates, if any."""
        if self._json is not None:
            found = self._json["templates_dir"]
            return None if found is None else Path(found)
        return self.loaded.templates_dir
