"""Fair share in the lease book (hostside/fairshare.py): decay, the order of the queue (use,
then age, without bound), the admin's policy file and its limits, a day of four users
simulated with the real queue code, and where use is read from (the owner's own records,
root's ledger) -- files only, one user (unit tier). Two real users are in
tests/hostside/test_fairshare_users.py."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from orchestrate.hostside import fairshare, leases
from orchestrate.hostside.fairshare import QueuePolicy, Used, ordered, usage
from orchestrate.hostside.leaserecord import Lease, Ticket

pytestmark = pytest.mark.unit

DAY = 86400.0
NOW = 1.8e9


def _ticket(job: str, uid: int, submitted: float, gpus: int = 1) -> Ticket:
    return Ticket(job, uid, submitted, user=f"u{uid}", gpus=list(range(gpus)))


def test_use_halves_every_half_life() -> None:
    hour = fairshare.decayed(2, NOW - 3600, NOW, NOW, DAY)
    assert hour == pytest.approx(7200, rel=0.02)  # 2 GPUs for an hour, just now (decaying)
    assert fairshare.decayed(2, NOW - 3600, NOW, NOW + DAY, DAY) == pytest.approx(hour / 2)
    assert fairshare.decayed(2, NOW, NOW - 5, NOW, DAY) == 0.0


def test_the_light_users_one_job_goes_before_the_heavy_users_ten() -> None:
    heavy, light = 1001, 1002
    use = usage([Lease("h-run", heavy, gpus=[0, 1, 2, 3], since=NOW - 6 * 3600)],
                [Used("h-old", heavy, 4, NOW - DAY, NOW - DAY / 2)], NOW, DAY)
    queue = [_ticket(f"h{n}", heavy, NOW - 3600 + n) for n in range(10)]
    queue.append(_ticket("l1", light, NOW - 60))  # submitted last
    assert [t.job_id for t in ordered(queue, use, QueuePolicy(), NOW)][:2] == ["l1", "h0"]
    fifo = ordered(queue, use, QueuePolicy(order="fifo"), NOW)
    assert fifo[0].job_id == "h0" and fifo[-1].job_id == "l1"


def test_a_job_that_waits_long_enough_goes_before_any_user_with_use() -> None:
    """Age raises a job without bound: the heavy user's old job passes a light user who used
    a little, given time; a user with no use at all still goes first (ties: oldest first)."""
    use = {1001: 50 * 3600.0, 1002: 60.0}
    old, new = _ticket("old", 1001, NOW), _ticket("new", 1002, NOW)
    for waited, first in ((0.0, "new"), (DAY, "new"), (20 * DAY, "old")):
        new.submitted_at = NOW + waited
        assert ordered([old, new], use, QueuePolicy(), NOW + waited)[0].job_id == first
    nobody = _ticket("fresh", 1003, NOW + 20 * DAY)
    assert ordered([old, nobody], use, QueuePolicy(), NOW + 20 * DAY)[0].job_id == "fresh"


def test_a_multi_host_jobs_carried_use_raises_its_place_never_lowers_it() -> None:
    use = {1001: 100.0, 1002: 200.0}
    gang = _ticket("gang", 1001, NOW)
    other = _ticket("other", 1002, NOW)
    assert ordered([other, gang], use, QueuePolicy(), NOW)[0].job_id == "gang"
    gang.usage, gang.usage_at = 1000.0, NOW  # its owner's use on its busiest host
    assert ordered([other, gang], use, QueuePolicy(), NOW)[0].job_id == "other"
    gang.usage = 1.0  # a lower floor than this host's own count changes nothing
    assert ordered([other, gang], use, QueuePolicy(), NOW)[0].job_id == "gang"


def test_two_hosts_order_two_gang_jobs_alike_at_claim_time_not_only_at_preflight() -> None:
    """ann runs 4 GPUs on h2 (none on h1); her 2-host job's ticket carries her h2 use, read at
    the preflight. Ten minutes later, at the claim, h2's own count has grown: with the rate the
    ticket carries, h1 brings the carried use to the same number, so both hosts put ben's
    gang job (a constant use) on the same side of hers; without it h1 put hers first."""
    ann, ben, half = 1001, 1002, DAY
    running = [Lease("a-run", ann, gpus=[0, 1, 2, 3], since=NOW - 3600)]
    preflight, claim = NOW, NOW + 600
    h2_then = usage(running, [], preflight, half)[ann]
    h2_now = usage(running, [], claim, half)[ann]
    hers = _ticket("a-gang", ann, NOW - 100)
    hers.usage, hers.usage_at, hers.usage_rate = h2_then, preflight, 4.0
    assert fairshare.floor(hers, claim, half) == pytest.approx(h2_now, rel=1e-9)
    his = _ticket("b-gang", ben, NOW - 50)
    his.usage, his.usage_at = (h2_then + h2_now) / 2, claim  # between the two counts
    on_h2 = ordered([hers, his], {ann: h2_now, ben: his.usage}, QueuePolicy(), claim)
    on_h1 = ordered([hers, his], {}, QueuePolicy(), claim)
    assert [t.job_id for t in on_h1] == [t.job_id for t in on_h2] == ["b-gang", "a-gang"]
    hers.usage_rate = 0.0  # the stale count: h1 disagreed with h2
    assert ordered([hers, his], {}, QueuePolicy(), claim)[0].job_id == "a-gang"


def test_one_users_gang_jobs_keep_their_order_whatever_use_each_ticket_carries() -> None:
    """Two 2-host jobs of one user, their use read at two preflights a moment apart: the
    older ticket carrying a little more (its preflight saw another lease's count) must not
    let the younger pass it (CI: gang-c ran before gang-b). A user's own jobs go first come,
    first served."""
    older, younger = _ticket("gang-b", 1001, NOW - 2), _ticket("gang-c", 1001, NOW - 1)
    older.usage, older.usage_at = 50.5, NOW - 2
    younger.usage, younger.usage_at = 50.0, NOW - 1
    for use in ({}, {1001: 10.0}):
        assert [t.job_id for t in ordered([younger, older], use, QueuePolicy(), NOW)] == [
            "gang-b", "gang-c"]


def test_a_users_waiting_jobs_beyond_the_limit_go_last_and_the_rule_is_named() -> None:
    policy = QueuePolicy(max_waiting_per_user=2, source="/book/policy.json")
    queue = [_ticket(f"h{n}", 1001, NOW + n) for n in range(4)]
    queue.append(_ticket("l1", 1002, NOW + 10))
    use = {1001: 0.0, 1002: 1e6}  # the light user is no light user here
    assert [t.job_id for t in ordered(queue, use, policy, NOW + 20)] == \
        ["h0", "h1", "l1", "h2", "h3"]
    assert fairshare.why_late(queue[2], queue, policy) == (
        "policy max_waiting_per_user: 2 (u1001 has 2 waiting; /book/policy.json)")
    assert fairshare.why_late(queue[1], queue, policy) == ""


def test_max_gpus_per_user_is_named_when_a_claim_would_pass_it() -> None:
    policy = QueuePolicy(max_gpus_per_user=4, source="/book/policy.json")
    held = [Lease("a", 1001, gpus=[0, 1, 2]), Lease("b", 1002, gpus=[3, 4, 5, 6])]
    assert fairshare.over_limit(1001, "ann", 1, held, policy) == ""
    assert fairshare.over_limit(1001, "ann", 2, held, policy) == (
        "policy max_gpus_per_user: 4 (ann holds 3, this job wants 2; /book/policy.json)")


def test_the_policy_file_is_believed_only_when_roots_alone(tmp_path: Path) -> None:
    assert fairshare.read_policy(str(tmp_path)) == QueuePolicy()
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"order": "fair", "half_life_s": 3600, "max_gpus_per_user": 4}))
    path.chmod(0o644)
    policy = fairshare.read_policy(str(tmp_path))
    assert (policy.half_life_s, policy.max_gpus_per_user, policy.source) == \
        (3600.0, 4, str(path))
    os.chown(path, 4242, 4242)  # a user's file: anyone could have put it there
    ignored = fairshare.read_policy(str(tmp_path))
    assert ignored.half_life_s == DAY and "must belong to root" in ignored.problem
    os.chown(path, 0, 0)
    path.write_text(json.dumps({"half_life_s": "1d"}))
    bad = fairshare.read_policy(str(tmp_path))
    assert bad.half_life_s == DAY
    assert "half_life_s: not a number from 60 to 3.1536e+07 (got '1d')" in bad.problem
    path.write_text(json.dumps({"max_gpu_per_user": 4}))
    assert "max_gpu_per_user: not a policy field" in fairshare.read_policy(str(tmp_path)).problem


def simulate(seed: int, policy: QueuePolicy, gpus: int = 8, step: float = 60.0) -> dict[int, float]:
    """A day of a lab server with the real queue code: four users who always keep three jobs
    waiting (sizes 1; 1-2; 2-4; 4 GPUs, 5 to 60 minutes each); every minute ended jobs leave
    records, and waiting jobs start in the queue's order while the first one fits (every job
    may use any GPU: the head of the queue blocks the rest, as the book does). Returns each
    user's share of the GPU-seconds given."""
    rng = random.Random(seed)
    sizes = {1001: [1], 1002: [1, 2], 1003: [2, 4], 1004: [4]}
    waiting: list[tuple[Ticket, float]] = []
    running: list[tuple[Lease, float]] = []
    records: list[Used] = []
    given = dict.fromkeys(sizes, 0.0)
    for minute in range(int(DAY / step)):
        now = NOW + minute * step
        for lease, end in [r for r in running if r[1] <= now]:
            running.remove((lease, end))
            records.append(Used(lease.job_id, lease.uid, len(lease.gpus), lease.since, end))
        for uid, choices in sizes.items():
            while sum(t.uid == uid for t, _ in waiting) < 3:
                ticket = _ticket(f"j{minute}.{uid}.{len(waiting)}", uid, now, rng.choice(choices))
                waiting.append((ticket, rng.uniform(300, 3600)))
        use = usage([lease for lease, _ in running], records, now, policy.half_life_s)
        free = gpus - sum(len(lease.gpus) for lease, _ in running)
        lengths = {t.job_id: length for t, length in waiting}
        for ticket in ordered([t for t, _ in waiting], use, policy, now):
            if len(ticket.gpus) > free:
                break
            free -= len(ticket.gpus)
            waiting.remove((ticket, lengths[ticket.job_id]))
            lease = Lease(ticket.job_id, ticket.uid, gpus=ticket.gpus, since=now)
            running.append((lease, now + lengths[ticket.job_id]))
        for lease, _ in running:
            given[lease.uid] += len(lease.gpus) * step
    total = sum(given.values())
    return {uid: value / total for uid, value in given.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_day_of_four_users_gives_each_their_share_within_ten_percent(seed: int) -> None:
    shares = simulate(seed, QueuePolicy())
    assert all(abs(share - 0.25) <= 0.025 for share in shares.values()), shares
    fifo = simulate(seed, QueuePolicy(order="fifo"))  # the 4-GPU user takes what others leave
    assert max(abs(share - 0.25) for share in fifo.values()) > \
        max(abs(share - 0.25) for share in shares.values())


def test_queue_order_of_a_thousand_waiting_jobs_is_quick() -> None:
    rng = random.Random(7)
    queue = [_ticket(f"j{n}", 1001 + n % 5, NOW - rng.uniform(0, DAY)) for n in range(1000)]
    use = {1001 + n: rng.uniform(0, 1e6) for n in range(5)}
    spent = []
    for _ in range(3):  # CPU time, the best of three: a busy machine's waits are not the code's
        start = time.process_time()
        ordered(queue, use, QueuePolicy(), NOW)
        spent.append(time.process_time() - start)
    assert min(spent) < 0.1  # bench/shared_book.py measures it: ~2 ms


def test_an_ended_lease_leaves_a_record_its_owner_is_charged_for(tmp_path: Path) -> None:
    book = leases.LeaseBook(str(tmp_path / "leases"), "box")
    lease = leases.new_lease("j1", "localhost", [0, 1], 0, None, [os.getpid()])
    lease.since = time.time() - 3600
    with book.locked():
        book.record(lease)
    assert book.leave("j1", [os.getpid()])
    [record] = (tmp_path / "leases" / "box").glob(f"j1@{os.geteuid()}.*.used")
    with book.locked():
        book.live()
        use = fairshare.use(book)
    assert use[os.geteuid()] == pytest.approx(7200, rel=0.05)  # 2 GPUs, an hour
    forged = record.with_name("j2@4242.0123456789abcdef.used")  # "4242 used 8 GPUs all day"
    forged.write_text(json.dumps({"units": 8, "start": time.time() - DAY, "end": time.time()}))
    with book.locked():
        book.live()
        assert 4242 not in fairshare.use(book)  # nobody writes use for someone else
    assert any("is not named for its owner" in line for line in book.problems)


def test_roots_ledger_keeps_use_its_owner_deletes_later(tmp_path: Path) -> None:
    book = leases.LeaseBook(str(tmp_path / "leases"), "box")
    lease = leases.new_lease("j1", "localhost", [0], 0, None, [os.getpid()])
    lease.since = time.time() - 3600
    with book.locked():
        book.record(lease)
        book.live()
        fairshare.fold(book)  # root, from cron, while the job runs
    book.leave("j1", [os.getpid()])
    with book.locked():
        book.live()
        fairshare.fold(book)  # after it ended: only the rest of its record is added
        before = fairshare.use(book)[os.geteuid()]
    for record in (tmp_path / "leases" / "box").glob("*.used"):
        record.unlink()  # its owner hides what he used
    with book.locked():
        book.live()
        assert fairshare.use(book)[os.geteuid()] == pytest.approx(before, rel=0.01)
    assert before == pytest.approx(3600, rel=0.05)  # counted once, not twice
    ledger = Path(fairshare.ledger_path(book.directory))
    os.chown(ledger, 4242, 4242)  # a user's own "ledger" is not believed
    with book.locked():
        book.live()
        assert os.geteuid() not in fairshare.use(book)


def test_a_waiting_job_is_told_its_place_and_the_rule_that_holds_it() -> None:
    from orchestrate.backends.sharing import blocked

    held: dict[str, list[str]] = {"unknown": []}
    said = blocked(held, ["job b7 (ben, since 10:02:11)", "job c1 (cy, since 10:05:00)",
                          "policy max_gpus_per_user: 4 (ann holds 3, this job wants 2; "
                          "/book/policy.json)"], "job.yaml")
    assert said is not None and said.exit_status == 75
    text = " ".join(p.message for p in said.problems)
    assert text.startswith("place 3 in the queue: 2 job(s) ahead of it want the same GPUs or "
                           "slots: job b7 (ben, since 10:02:11); job c1")
    assert "policy max_gpus_per_user: 4 (ann holds 3" in text
    assert "recent use" in said.problems[0].hint
    assert blocked(held, [], "job.yaml") is None


def test_a_claim_no_one_waits_beside_reads_no_ended_record(tmp_path: Path) -> None:
    # Every ended job's record is read to order a queue (hundreds after a busy week), on the
    # launch's path: a claim with no ticket waiting reads none; with one, the order needs them.
    book = leases.LeaseBook(str(tmp_path / "leases"), "box")
    forged = tmp_path / "leases" / "box" / "j0@4242.0123456789abcdef.used"  # named for another
    forged.write_text(json.dumps({"units": 8, "start": time.time() - DAY, "end": time.time()}))
    me = os.getpid()
    alone = book.claim(leases.new_lease("alone", "localhost", [0], 0, None, [me]))
    assert alone["ok"] is True
    assert not any(forged.name in line for line in alone["problems"])
    with book.locked():
        book.forget_lease("alone")
        book.enqueue(Ticket(job_id="first", uid=os.geteuid(), submitted_at=time.time(),
                            gpus=[0], holders=[(me, None)]))
    mine = Ticket(job_id="second", uid=os.geteuid(), submitted_at=time.time() + 1, gpus=[0],
                  holders=[(me, None)])
    queued = book.claim(leases.new_lease("second", "localhost", [0], 0, None, [me]), ticket=mine)
    assert queued["ok"] is False and "job first" in queued["queue"][0]
    assert any(forged.name in line and "is not named for its owner" in line
               for line in queued["problems"])
