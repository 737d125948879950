"""Preflight, re-plan, lease, copy and start: one set of connections from check to launch.

The steps, each in parallel over the hosts (at most ``ssh.fanout`` being set up at once):

1. connect to every node of the plan and open one pty channel per rank, each running the
   agent; local rank 0's channel answers the host's preflight request;
2. judge the answers against the plan; any failed check stops here with nothing launched
   (once the plan holds, every node also connects to MASTER_ADDR's port, held by a probe
   listener on rank 0's node for that moment: :mod:`.reach`);
3. re-plan when the hosts said so: GPUs held by other jobs' leases (``busy_gpus``), a busy derived
   master port (``master_port``, picked with :func:`~orchestrate.core.plan.ports.pick_port` from the
   ports the master host found free) and the network interface towards MASTER_ADDR where the
   inventory
   names none (``interfaces``); nodes whose questions changed are asked again;
4. claim the plan's GPUs and port in each host's lease book (under flock there); a host where
   another job claimed them meanwhile sends the plan back to step 3;
5. copy each node's launch script (and train.json) into the run directory on the node;
6. hand the channels to the supervisor as rank handles.

The pty channels opened in step 1 are the ranks' channels: a login per rank in all, which is
what keeps fan-out as cheap as pdsh's (on many systems each login runs the user's shell startup
files, and that, not the network, is what costs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from orchestrate.backends.sharing import FOREIGN_POLL_S
from orchestrate.backends.ssh.channels import ChannelError, SSHRank
from orchestrate.backends.ssh.connections import (
    ConnectError,
    Links,
    Target,
    fan_out,
    targets_for,
)
from orchestrate.backends.ssh.facts import ClaimAnswer, HostFacts
from orchestrate.backends.ssh.preflight import HostAnswer, Judgement, judge, request
from orchestrate.backends.ssh.reach import reach_master
from orchestrate.backends.ssh.reaping import HostStopper
from orchestrate.backends.ssh.sessions import READY_TIMEOUT_S, HostPool
from orchestrate.backends.ssh.wire import (
    Claim,
    Files,
    Preflight,
    Queue,
    Start,
    StepAnswer,
    WireError,
)
from orchestrate.core.errors import UserError
from orchestrate.core.layout import OWN_REACH_CHECK, node_script_name
from orchestrate.core.plan.plan import NodePlan, Occupancy, Plan
from orchestrate.core.plan.rankenv import ATTEMPT_VAR
from orchestrate.core.queueing import ends_within_s
from orchestrate.core.spec.inventory import Inventory
from orchestrate.run.progress import hosts, show

if TYPE_CHECKING:
    from orchestrate.run.prepare import Prepared

PREFLIGHT_TIMEOUT_S = 300.0  # includes `import torch` on a cold cache
STEP_TIMEOUT_S = 30.0
MAX_ROUNDS = 5

Replan = Callable[[Occupancy], "Prepared"]
#: A waiting job's ticket for one node (None: the job does not wait).
Tickets = Callable[[NodePlan], dict[str, Any]] | None


class PreflightFailed(Exception):
    """Some host failed a check; nothing was launched."""

    def __init__(self, verdict: Judgement, targets: Mapping[str, Target]) -> None:
        super().__init__(f"preflight failed on {len({t.name for t, _, _ in verdict.failures})} "
                         "host(s)")
        self.verdict = verdict
        self.targets = dict(targets)


class Cancelled(Exception):
    """The supervisor was asked to stop before the job started."""


def needs_interface(inventory: Inventory) -> set[str]:
    """Nodes whose inventory entry names no network interface: preflight discovers theirs."""
    return {n.name for n in inventory.nodes if n.network is None or not n.network.interface}


class Launcher:
    """Brings a prepared SSH job from checks to running rank channels."""

    def __init__(
        self,
        prepared: Prepared,
        replan: Replan,
        pool: HostPool,
        stop_requested: Callable[[], str | None] = lambda: None,
        log: Callable[[str], None] = lambda text: None,
        tickets: Tickets = None,
    ) -> None:
        self.prepared = prepared
        self.tickets = tickets
        self.replan = replan
        self.pool = pool
        self.stop_requested = stop_requested
        self.log = log
        self.fanout = prepared.plan.ssh.fanout
        self.connect_timeout_s = prepared.plan.ssh.connect_timeout_s
        self.facts: dict[str, HostAnswer] = {}
        self.refused: dict[str, list[str]] = {}  # host -> why its claim was refused
        self.discover = needs_interface(prepared.inventory)
        self.timings: dict[str, float] = {}
        self._reached: tuple[str, int] | None = None  # the master address and port checked

    def follow(self, previous: Launcher) -> None:
        """A restart on the hosts ``previous`` checked, over its connections: what they
        answered (torch's version: not imported again) and the master's address and port
        they reached, seconds ago (the reach check runs again only for another one)."""
        self.facts.update(previous.facts)
        self._reached = previous._reached

    @property
    def links(self) -> Links:
        """The connections, for stopping the job later."""
        return self.pool.links

    # ------------------------------------------------------------------ steps

    def targets(self, plan: Plan) -> dict[str, Target]:
        """The plan's hosts."""
        return targets_for(plan, self.prepared.inventory, self.connect_timeout_s)

    def check(self, plan: Plan, with_ranks: bool = True) -> Judgement:
        """Ask every node of ``plan`` whose questions changed; judge all answers."""
        targets = self.targets(plan)
        show("logging in", hosts([node.name for node in plan.nodes]))
        for node in plan.nodes:  # log in everywhere at once (a no-op where it started)
            self.pool.open(targets[node.name], node.nproc if with_ranks else 1)
        logged_in = self.pool.sessions()
        todo = []
        for node in plan.nodes:
            session = logged_in.get(node.name)
            known = self.facts.get(node.name)
            torch = known.facts.torch if known is not None and known.facts is not None else None
            torch_ok = torch is not None and torch.ok
            wanted = request(plan, node, node.name in self.discover, torch_ok,
                             lease_dir=targets[node.name].lease_dir, want=self._want(node))
            if session is None or session.asked is None or known is None \
                    or _differs(session.asked, wanted):
                todo.append((node, wanted))
        if todo:
            started = time.monotonic()
            by_name = {node.name: (node, wanted) for node, wanted in todo}
            answers = fan_out(
                [targets[name] for name in by_name],
                lambda t: self._ask(t, *by_name[t.name], with_ranks=with_ranks),
                self.fanout,  # in plan order, like the logins they wait for: no deadlock
            )
            for name, answer in answers.items():
                if answer.value is not None:
                    answer.value.keep_torch(self.facts.get(name))
                    self.facts[name] = answer.value
                else:
                    self.facts[name] = HostAnswer(targets[name], failed="ssh",
                                                 detail=f"internal error: {answer.error}")
            self.timings["preflight_s"] = round(self.timings.get("preflight_s", 0.0)
                                                + time.monotonic() - started, 3)
        return judge(plan, self.facts, self.discover)

    def _ask(self, target: Target, node: NodePlan, wanted: Preflight,
             with_ranks: bool) -> HostAnswer:
        try:
            session = self.pool.session(target, node.nproc if with_ranks else 1)
        except ConnectError as exc:
            return HostAnswer(target, failed=exc.check, detail=exc.detail)
        except ChannelError as exc:
            return HostAnswer(target, failed="python", detail=str(exc))
        except Exception as exc:  # paramiko's own errors on a half-open connection, ...
            return HostAnswer(target, failed="ssh", detail=f"{type(exc).__name__}: {exc}")
        asked_at = time.monotonic()
        show("preflight", target.name)
        try:
            facts = HostFacts.from_json(
                session.channels[0].request(wanted, "preflight", PREFLIGHT_TIMEOUT_S))
        except ChannelError as exc:
            return HostAnswer(target, failed="python", detail=f"preflight did not answer: {exc}")
        except WireError as exc:
            return HostAnswer(target, failed="python", detail=f"preflight answer: {exc}")
        for line in facts.leases.problems:  # files of the host's book it ignored or could not use
            self.log(f"{target.label}: lease book: {line}")
        for step, took in (*session.timings.items(), ("answer_s", time.monotonic() - asked_at)):
            self.timings[step] = max(self.timings.get(step, 0.0), round(took, 3))
        session.asked = wanted
        session.hostname = facts.hostname or target.name
        return HostAnswer(target, facts=facts)

    def _want(self, node: NodePlan) -> dict[str, Any]:
        """What the job asks of ``node``'s queue: its ticket when it waits, else what it may
        take (a claim without a place in the queue: behind every waiting job)."""
        from orchestrate.backends.sharing import wants

        if self.tickets is not None:
            return self._ticket(node)
        return wants(self.prepared, node)

    def _ticket(self, node: NodePlan) -> dict[str, Any]:
        """The job's ticket for ``node``. A multi-host job's carries its owner's use on the
        busiest of its hosts (each host's preflight says it) and how fast it grew then, so
        that every host orders it alike at claim time, not only at the preflight: a host
        takes the larger of it (brought up to now) and its own count."""
        assert self.tickets is not None
        ticket = dict(self.tickets(node))
        if len(self.prepared.plan.nodes) > 1:
            uses = [(a.facts.leases.use, a.facts.leases.use_rate)
                    for a in self.facts.values() if a.facts is not None]
            ticket["usage"], ticket["usage_rate"] = max(uses, default=(0.0, 0.0))
            ticket["usage_at"] = time.time()
        return ticket

    def settle(self) -> Prepared:
        """Preflight, re-plan and claim until the plan holds; returns the plan to launch.

        Raises :class:`PreflightFailed` (a check failed), :class:`UserError` (no plan fits what
        the hosts hold, or older waiting jobs want it) or :class:`Cancelled`.
        """
        prepared = self.prepared
        port: int | None = None
        interfaces: dict[str, str] = {}
        last: dict[str, Any] | None = None
        for _ in range(MAX_ROUNDS):
            self._cancel_point()
            plan = prepared.plan
            verdict = self.check(plan)
            for node, lines in verdict.health.items():
                for line in lines:
                    self.log(f"GPU health on {node}: {line}")
            self._drop_unused(plan)
            if not verdict.ok:
                raise PreflightFailed(verdict, self.targets(plan))
            self._refuse_waits(verdict)
            # What other jobs hold (GPUs, CPU slots) and GPUs in use outside orchestrate: the
            # planner decides again whenever they differ from what the plan was made with.
            shared = _merge(verdict.sharing)
            port = verdict.port if verdict.port is not None else port
            interfaces.update(verdict.interfaces)
            found = {**shared, "port": port, "interfaces": dict(interfaces)}
            if verdict.replan or (found != last and (last is not None or any(shared.values()))):
                last = found
                self.log(f"re-plan: {shared or 'nothing held'}, port {port}, "
                         f"interfaces {interfaces}")
                started = time.monotonic()
                prepared = self.replan(Occupancy(master_port=port, interfaces=interfaces,
                                                 **shared))
                self.timings["replan_s"] = round(time.monotonic() - started, 3)
                continue
            self._cancel_point()
            self._reach(plan)
            started = time.monotonic()
            claimed = self._claim(plan)
            self.timings["claim_s"] = round(time.monotonic() - started, 3)
            if claimed:
                self.prepared = prepared
                return prepared
            ahead = [f"{n}: {q}" for n, qs in self.refused.items() for q in qs[:3]]
            # a waiting job holds nothing while it waits; an admin's rule (policy.json) holds
            # whatever the plan, so planning again cannot help: both are told, naming it
            if self.tickets is not None or any(q.startswith("policy ")
                                               for qs in self.refused.values() for q in qs):
                raise UserError.single(
                    "; ".join(ahead) or "another job claimed what the plan needs meanwhile",
                    source=str(self.prepared.path), field="preflight", busy=True)
        raise UserError.single(
            f"the plan kept changing: other jobs took its GPUs or port {MAX_ROUNDS} times",
            source=str(self.prepared.path), field="preflight", hint="submit again", busy=True,
        )

    def _reach(self, plan: Plan) -> None:
        """Every node reaches MASTER_ADDR's port (:mod:`.reach`), once per address and port;
        raises :class:`PreflightFailed` naming each node that cannot. Not for a job that checks
        it itself (the doctor's checkup: its connect tier makes the same check per node pair,
        bounded, and names the host that cannot reach; refused here, it read as a launch
        failure of master and host)."""
        if (plan.master_addr, plan.master_port) == self._reached or _is_checkup(plan):
            return
        started = time.monotonic()
        targets = self.targets(plan)
        sessions = self.pool.sessions()
        failures = reach_master(plan, {n: s.channels[0] for n, s in sessions.items()},
                                targets, self.fanout)
        self.timings["reach_s"] = round(time.monotonic() - started, 3)
        if failures:
            verdict = judge(plan, self.facts, self.discover)
            verdict.failures.extend(failures)
            for target, check, detail in failures:
                verdict.cells.setdefault(target.name, {})[check] = detail
            raise PreflightFailed(verdict, targets)
        self._reached = (plan.master_addr, plan.master_port)

    def _refuse_waits(self, verdict: Judgement) -> None:
        """Older waiting jobs want the same things, or a lease cannot be read: exit 75."""
        from orchestrate.backends.sharing import QUEUE_HINT

        waits = [f"{name}: {why}" for name, whys in verdict.waits.items() for why in whys]
        if waits:
            raise UserError.single(
                "; ".join(waits), source=str(self.prepared.path), field="resources", busy=True,
                hint=QUEUE_HINT + "; an unreadable lease is its owner's to remove")

    def enqueue(self) -> None:
        """A waiting job: keep its place in the queue of every host it is logged into (and
        drop any claim it made meanwhile: it holds nothing while it waits)."""
        if self.tickets is None:
            return
        plan = self.prepared.plan
        sessions = self.pool.sessions()
        targets = self.targets(plan)
        nodes = [n for n in plan.nodes if n.name in sessions]

        def put(target: Target) -> StepAnswer:
            node = next(n for n in nodes if n.name == target.name)
            channel = sessions[node.name].channels[0]
            return StepAnswer.from_json(channel.request(
                Queue(job_id=plan.job_id, lease_dir=target.lease_dir, ticket=self._ticket(node)),
                "queue", STEP_TIMEOUT_S))

        fan_out([targets[n.name] for n in nodes], put, self.fanout)

    def _gang(self, targets: dict[str, Target], claim: Callable[[Target], ClaimAnswer]
              ) -> dict[str, Any]:
        """A waiting multi-host job claims one host after another in one global order (by
        host name), stopping at the first refusal: two such jobs never each hold half of
        what the other waits for (the one refused first holds nothing; its waiting drops
        what it holds)."""
        def name(node: str) -> tuple[str, str]:
            facts = self.facts[node].facts if node in self.facts else None
            return (facts.hostname if facts is not None else node, node)

        answers: dict[str, Any] = {}
        for node in sorted(targets, key=name):
            answers.update(fan_out([targets[node]], claim, self.fanout))
            answer = answers[node]
            if answer.error is not None or answer.value is None or not answer.value.ok:
                break
        return answers

    def _claim(self, plan: Plan) -> bool:
        """Claim every node's GPUs and port; False (with facts updated) on a conflict."""
        def claim(target: Target) -> ClaimAnswer:
            node = next(n for n in plan.nodes if n.name == target.name)
            channel = self.pool.sessions()[node.name].channels[0]
            spec = self.prepared.inventory.node(node.name)
            cpu = not node.gpu_indices
            return ClaimAnswer.from_json(channel.request(Claim(
                job_id=plan.job_id, node=node.name, lease_dir=target.lease_dir,
                ticket=self._ticket(node) if self.tickets is not None else None,
                gpus=list(node.gpu_indices),
                slots=node.nproc if cpu else 0,
                slot_capacity=spec.capacity if cpu and spec is not None else None,
                port=plan.master_port if node.node_rank == 0 else None,
                ends_within_s=ends_within_s(plan.time_limit),
            ), "claim", STEP_TIMEOUT_S))

        targets = self.targets(plan)
        show("claiming GPUs and the port", hosts(list(targets)))
        self.refused = {}
        answers = self._gang(targets, claim) if self.tickets is not None and len(targets) > 1 \
            else fan_out(list(targets.values()), claim, self.fanout)
        failures = Judgement()
        conflict = False
        for name, answer in answers.items():
            if answer.error is not None:
                failures.failures.append((targets[name], "leases", f"claim failed: {answer.error}"))
                continue
            reply = answer.value
            for line in reply.problems if reply is not None else ():
                self.log(f"{targets[name].label}: lease book: {line}")
            if reply is None or reply.ok:
                continue
            conflict = True
            self.refused[name] = list(reply.queue)
            self.facts[name] = self.facts[name].taken(reply, plan.master_port)
        if failures.failures:
            verdict = judge(plan, self.facts, self.discover)
            verdict.failures.extend(failures.failures)
            for target, check, detail in failures.failures:
                verdict.cells.setdefault(target.name, {})[check] = detail
            raise PreflightFailed(verdict, targets)
        return not conflict

    def copy(self, prepared: Prepared, rendered: Mapping[str, str]) -> None:
        """Write into the run dir on each node what its ranks run there: its own launch script
        and every file that is not another node's (the sidecar, evidence.py, train.json), so
        no shared file system is needed."""
        plan = prepared.plan
        targets = self.targets(plan)
        nproc = {node.name: node.nproc for node in plan.nodes}
        scripts = {node_script_name(node.name) for node in plan.nodes}
        common = {name: text for name, text in rendered.items() if name not in scripts}

        def put(target: Target) -> None:
            show("copying the job's files", target.name)
            own = node_script_name(target.name)
            files = {own: rendered[own], **common}
            session = self.pool.session(target, nproc[target.name])  # a channel per rank
            reply = StepAnswer.from_json(session.channels[0].request(
                Files(run_dir=plan.run_dir, files=files), "files", STEP_TIMEOUT_S))
            if not reply.ok:
                raise ChannelError(f"writing {plan.run_dir}: {reply.detail}")
            for channel in session.channels[1:]:
                channel.ready(READY_TIMEOUT_S)

        started = time.monotonic()
        answers = fan_out(list(targets.values()), put, self.fanout)
        self.timings["copy_s"] = time.monotonic() - started
        failed = {name: a.error for name, a in answers.items() if a.error is not None}
        if failed:
            verdict = judge(plan, self.facts, self.discover)
            for name, error in failed.items():
                verdict.failures.append((targets[name], "workdir", f"copy failed: {error}"))
                verdict.cells[name]["workdir"] = f"copy failed: {error}"
            raise PreflightFailed(verdict, targets)

    def handles(self, plan: Plan, stopper: HostStopper, grace_s: float,
                attempt: int = 1) -> list[SSHRank]:
        """A rank handle per rank, on the channels opened in preflight; under a launcher that
        starts workers (``per_node``, ``torchrun``) one per node, recorded as its first rank,
        whose launch script takes no local rank."""
        handles = []
        sessions = self.pool.sessions()
        for node in plan.nodes:
            session = sessions[node.name]
            script = f"{plan.run_dir}/{node_script_name(node.name)}"
            starts = [(node.first_rank, None)] if plan.per_node else \
                [(rank.rank, rank.local_rank) for rank in node.ranks]
            for rank, local_rank in starts:
                handles.append(SSHRank(
                    rank=rank,
                    node=node.name,
                    channel=session.channels[local_rank or 0],
                    start_request=Start(job_id=plan.job_id, script=script,
                                        local_rank=local_rank, grace_s=grace_s,
                                        env={ATTEMPT_VAR: str(attempt)},
                                        watch_s=FOREIGN_POLL_S if node.gpu_indices
                                        and rank == node.first_rank else None),
                    stop_host=_stopper_for(stopper, node.name),
                ))
        return handles

    def hostnames(self) -> dict[str, str]:
        """What each host calls itself (for the store)."""
        return {name: s.hostname for name, s in self.pool.sessions().items() if s.hostname}

    # ------------------------------------------------------------------ teardown

    def _drop_unused(self, plan: Plan) -> None:
        """Log out of hosts a re-plan no longer uses; drop channels beyond a node's ranks."""
        used = {node.name: node.nproc for node in plan.nodes}
        for name in self.pool.names():
            self.pool.trim(name, used.get(name, 0))
            if name not in used:
                self.facts.pop(name, None)

    def abort(self) -> None:
        """Nothing will start: tell every agent to release its claim and go; close all."""
        self.pool.close(abort_all=True)

    def _cancel_point(self) -> None:
        reason = self.stop_requested()
        if reason:
            raise Cancelled(reason)


def _merge(sharing: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Every node's Occupancy fields (:func:`orchestrate.backends.sharing.occupancy`), merged."""
    merged: dict[str, dict[str, Any]] = {}
    for fields in sharing.values():
        for key, by_node in fields.items():
            merged.setdefault(key, {}).update(by_node)
    return dict(merged)


def _differs(asked: Preflight, wanted: Preflight) -> bool:
    return replace(asked, torch=False) != replace(wanted, torch=False)


def _stopper_for(stopper: HostStopper, node: str) -> Callable[[bool], None]:
    def stop(force: bool) -> None:
        stopper.stop(node, force)

    return stop


def _is_checkup(plan: Plan) -> bool:
    """Whether the job checks the master's reach itself (:data:`OWN_REACH_CHECK`)."""
    return plan.env.get(OWN_REACH_CHECK) == "1"
