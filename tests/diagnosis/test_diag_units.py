"""The stall rule and the classifier as pure functions, on data captured from real runs.

tests/diagnosis/captures/*.json were written by the real-process tests (test_diag_stalls.py and
test_diag_train.py, run with ``DIAG_CAPTURE=tests/diagnosis/captures``; torch 2.13.0+cpu, gloo, 3
ranks on loopback): the heartbeat trace the driver polled, every rank's answer to the dump
request (fresh heartbeat with flight-recorder ops and /proc state, faulthandler stacks), and
the stall. Variants below edit a real capture in one place (noted) to reach cases a loopback
machine cannot produce, such as a stalled network path.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from orchestrate.diagnosis.diagfiles import Answer, Frame, Heartbeat
from orchestrate.diagnosis.ranktable import idle_s, rank_table
from orchestrate.diagnosis.stacks import frame_kind, innermost_user_frame, parse_stacks
from orchestrate.diagnosis.stall import Diagnosis
from orchestrate.diagnosis.stallrule import Stall, StallWatch, format_ranks
from tests.support.diagcaptures import CAPTURES, NAMES, answers_of, beats_of, load, run_classify
from tests.support.diagranks import REPO, expand, install_site
from tests.support.python38 import python38 as _python38

pytestmark = pytest.mark.unit

# --- the classifier on real captures -----------------------------------------------------


def test_mismatch() -> None:
    diagnosis = run_classify(load("mismatch"))
    assert (diagnosis.kind, diagnosis.ranks, diagnosis.nodes) == ("mismatch", (2,), ("node-b",))
    assert diagnosis.summary == (
        "rank 2 (node node-b) is in barrier #16 at steps.py:70; ranks 0-1 are in all_reduce #16"
    )
    assert len(diagnosis.files) == 9 and all(f.startswith("/RUN/diag/") for f in diagnosis.files)


def test_laggard() -> None:
    data = load("laggard")
    diagnosis = run_classify(data)
    assert (diagnosis.kind, diagnosis.ranks) == ("laggard", (1,))
    waited = data["stall"].idle_s + data["now"] - data["stall"].at
    assert diagnosis.summary == (
        "rank 1 (node node-a) has not reached collective #15: it is in steps.py:45 `__next__` "
        f"(sleeping: hrtimer_nanosleep); ranks 0,2 wait in all_reduce #15 for {waited:.0f} s"
    )


def test_laggard_in_a_train_job() -> None:
    diagnosis = run_classify(load("train"))
    assert (diagnosis.kind, diagnosis.ranks, diagnosis.nodes) == ("laggard", (1,), ("node-b",))
    assert diagnosis.summary.startswith(
        "rank 1 (node node-b) has not reached collective #57: it is in stuck_data.py:32 "
        "`__getitem__` (sleeping: hrtimer_nanosleep); rank 0 waits in all_reduce #57 for "
    )


def test_frozen() -> None:
    data = load("frozen")
    diagnosis = run_classify(data)
    pid = data["heartbeats"][2]["pid"]
    age = data["stall"].ages[2] + data["now"] - data["stall"].at
    assert (diagnosis.kind, diagnosis.ranks) == ("frozen", (2,))
    assert diagnosis.summary == (
        f"rank 2 (node node-b, pid {pid}) stopped answering {age:.0f} s ago (process stopped or "
        "hung in native code)"
    )
    # without a dump request nobody can be called frozen: the others wait on rank 2
    heartbeats_only = run_classify(data, dumps=None)
    assert heartbeats_only.kind == "laggard" and heartbeats_only.ranks == (2,)


def test_rendezvous() -> None:
    data = load("rendezvous")
    diagnosis = run_classify(data)
    assert (diagnosis.kind, diagnosis.ranks) == ("rendezvous", (1,))
    assert diagnosis.summary == (
        "rank 1 (node node-a) never reached init_process_group (rank 1 is in steps.py:53 "
        f"`prepare`, sleeping: hrtimer_nanosleep); ranks 0,2 wait at {data['master']}"
    )


def test_rendezvous_with_a_rank_that_never_started() -> None:
    data = load("rendezvous")  # edited: rank 1 left no heartbeat and gave no answer
    del data["heartbeats"][1]
    data["dumps"][1] = None
    diagnosis = run_classify(data)
    assert diagnosis.kind == "rendezvous" and diagnosis.ranks == (1,)
    assert "(rank 1 has no heartbeat: it never started Python)" in diagnosis.summary


def test_every_rank_waiting_at_the_store() -> None:
    data = load("rendezvous")  # edited: rank 1 reached init_process_group too
    data["dumps"][1]["state"]["phase"] = "init_process_group"
    diagnosis = run_classify(data)
    assert diagnosis.kind == "rendezvous" and diagnosis.ranks == (0, 1, 2)
    assert diagnosis.summary.startswith(
        f"all 3 ranks wait in init_process_group at {data['master']}: "
    )


def _pg0(data: dict[str, Any], rank: int) -> dict[str, Any]:
    group: dict[str, Any] = data["dumps"][rank]["state"]["pgs"][0]
    return group


def test_transport() -> None:
    data = load("mismatch")  # edited: rank 2 made the same all_reduce as the others
    _pg0(data, 2).update(op="all_reduce", sizes=[[8]])
    diagnosis = run_classify(data)
    assert (diagnosis.kind, diagnosis.ranks) == ("transport", (0, 1, 2))
    assert diagnosis.summary.startswith("all 3 ranks in all_reduce #16 for ")
    assert diagnosis.summary.endswith(" s: the network path is stalled (interface lo)")


def test_shape_mismatch() -> None:
    data = load("mismatch")  # edited: rank 2's all_reduce has another size
    _pg0(data, 2).update(op="all_reduce", sizes=[[16]])
    diagnosis = run_classify(data)
    assert (diagnosis.kind, diagnosis.ranks) == ("mismatch", (2,))
    assert diagnosis.summary == (
        "rank 2 (node node-b) is in all_reduce #16 with sizes [[16]] at steps.py:70; "
        "ranks 0-1 are in all_reduce #16 with sizes [[8]]"
    )


def test_stuck_outside_collectives() -> None:
    data = load("laggard")  # edited: no collective in flight anywhere
    for rank in (0, 2):
        _pg0(data, rank)["enqueued"] = 14
    diagnosis = run_classify(data)
    assert diagnosis.kind == "user_code" and diagnosis.ranks == (0, 1, 2)
    assert diagnosis.summary.startswith("no rank is in a collective; ")
    assert "rank 1 is in steps.py:45 `__next__` (sleeping: hrtimer_nanosleep)" in (
        diagnosis.summary
    )


def test_a_rank_that_exited_is_not_frozen() -> None:
    data = load("frozen")
    assert run_classify(data, alive={0: True, 1: True, 2: False}).kind != "frozen"


def test_classify_without_a_stall_uses_the_ranks_clocks() -> None:
    data = load("laggard")
    diagnosis = run_classify(data, stall=None)
    since = min(_pg0(data, r)["op_since"] for r in (0, 2))
    assert diagnosis.summary.endswith(f" for {data['now'] - since:.0f} s")


def test_rank_table() -> None:
    data = load("train")
    rows = rank_table(beats_of(data["heartbeats"]), answers_of(data["dumps"]), data["now"],
                      data["nodes"])
    assert [(r.rank, r.node, r.phase, r.step, r.answered) for r in rows] == [
        (0, "node-a", "step", 47, True), (1, "node-b", "step", 47, True),
    ]
    control = rows[0].collectives[1]  # the stop-flag group: as many agreements as it made
    assert rows[0].collectives == ("group 0: all_reduce #57 waiting", control)
    assert rows[1].collectives == ("group 0: #56 done", control)
    assert control.startswith("group 1: #") and control.endswith(" done")
    assert rows[1].frame == "stuck_data.py:32 `__getitem__`"
    assert rows[1].kernel == "sleeping: hrtimer_nanosleep"
    assert rows[0].frame is not None and rows[0].frame.startswith("trainer.py:")
    assert json.loads(json.dumps(rows[0].to_json()))["collectives"][0].endswith("waiting")


def test_idle_from_heartbeats_alone() -> None:
    data = load("mismatch")
    idle = idle_s(beats_of(data["heartbeats"]))
    assert idle is not None and 10.0 <= idle <= 14.0  # stall_s was 12
    assert idle_s({0: None}) is None


# --- the records, on what real sidecars wrote ------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_records_read_back_exactly_what_real_ranks_wrote(name: str) -> None:
    data = load(name)
    for raw in data["heartbeats"].values():
        beat = Heartbeat.from_json(raw)
        assert beat is not None and beat.to_json() == raw
    for raw in data["dumps"].values():
        answer = Answer.from_json(raw)
        assert (raw is None and answer is None) or (answer is not None and answer.to_json() == raw)
    diagnosis = run_classify(data)
    assert Diagnosis.from_json(json.loads(json.dumps(diagnosis.to_json()))) == diagnosis
    assert Stall.from_json(json.loads(json.dumps(data["stall"].to_json()))) == data["stall"]


def test_damaged_records_read_as_nothing_or_fail_loudly() -> None:
    assert Heartbeat.from_json({}) is None and Heartbeat.from_json([1, 2]) is None
    beat = Heartbeat.from_json({"pid": "x", "step": 3, "pgs": [{"enqueued": 1}, {"pg": "0"}],
                                "stack": [["f.py", "x", "g"], ["f.py", 3, "g"]]})
    assert beat is not None and beat.pid is None and beat.step == 3
    assert [g.pg for g in beat.pgs or ()] == ["0"] and len(beat.stack) == 1
    with pytest.raises(KeyError):
        Diagnosis.from_json({"kind": "frozen", "summary": "no time"})
    with pytest.raises(ValueError):
        Diagnosis.from_json({"kind": "frozen", "summary": "s", "at": "soon"})


# --- the stall rule replayed on real traces --------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_stall_watch_replays_the_real_run(name: str) -> None:
    data = load(name)
    watch = StallWatch(data["stall_s"], data["heartbeat_s"])
    stalls = []
    for index, (now, rows, alive) in enumerate(data["trace"]):
        beats = {int(r): expand(row) for r, row in rows.items()}
        stall = watch.observe(now, beats, {int(r): a for r, a in alive.items()})
        if stall is not None:
            stalls.append((index, stall))
    assert [i for i, _ in stalls] == [len(data["trace"]) - 1]
    found = stalls[0][1]
    assert found.reason == data["stall"].reason
    assert found.silent == data["stall"].silent
    assert found.idle_s == pytest.approx(data["stall"].idle_s)


def test_train_trace_learns_the_step_time() -> None:
    data = load("train")
    watch = StallWatch(data["stall_s"], data["heartbeat_s"])
    for now, rows, alive in data["trace"]:
        watch.observe(now, {int(r): expand(row) for r, row in rows.items()}, alive)
    step = watch.step_time()
    assert step is not None and 0 < step < 1.0
    assert watch.threshold() == data["stall_s"]


# --- the stall rule on made-up heartbeats ---------------------------------------------------


def beat(n: int, *, step: int | None = None, phase: str = "step", pid: int = 7,
         **fields: Any) -> Heartbeat:
    """A made-up heartbeat, from its JSON fields."""
    found = Heartbeat.from_json({"pid": pid, "beat": n, "phase": phase, "step": step, "pgs": [],
                                 **fields})
    assert found is not None
    return found


def test_no_heartbeat_no_stall() -> None:
    watch = StallWatch(10, 1)
    for t in range(0, 100, 5):
        assert watch.observe(float(t), {0: None, 1: None}, {0: True, 1: True}) is None


def test_no_progress_after_stall_s_then_quiet_until_progress() -> None:
    def at(n: int, done: int) -> Heartbeat:
        return beat(n, phase="running", pgs=[{"pg": "0", "enqueued": 9, "completed": done}])

    watch = StallWatch(10, 1)
    for t in range(10):
        assert watch.observe(float(t), {0: at(t, 8)}, {0: True}) is None
    stall = watch.observe(10.0, {0: at(10, 8)}, {0: True})
    assert stall is not None and stall.reason == "no_progress" and stall.idle_s == 10.0
    assert stall.describe() == "no rank made progress for 10 s (bound 10 s)"
    assert watch.observe(30.0, {0: at(30, 8)}, {0: True}) is None  # reported once
    assert watch.observe(31.0, {0: at(31, 9)}, {0: True}) is None  # progress re-arms
    assert watch.observe(40.0, {0: at(40, 9)}, {0: True}) is None
    assert watch.observe(41.0, {0: at(41, 9)}, {0: True}) is not None


def test_slow_steps_raise_the_bound() -> None:
    watch = StallWatch(10, 1, step_factor=5)
    for step in range(6):
        assert watch.observe(4.0 * step, {0: beat(step, step=step)}, {0: True}) is None
    assert watch.step_time() == 4.0 and watch.threshold() == 20.0
    assert watch.observe(20.0 + 19.0, {0: beat(99, step=5)}, {0: True}) is None
    assert watch.observe(20.0 + 20.0, {0: beat(100, step=5)}, {0: True}) is not None


def test_silent_rank_while_its_process_lives() -> None:
    watch = StallWatch(60, 1)  # silent_s = max(30, 10) = 30
    assert watch.silent_s == 30
    for t in range(31):
        beats = {0: beat(t, step=t), 1: beat(0, step=0)}
        found = watch.observe(float(t), beats, {0: True, 1: True})
        assert found is None or t == 30
    assert found is not None and found.reason == "silent" and found.silent == (1,)
    assert found.describe() == "rank 1: heartbeat stopped 30 s ago while the process lives"


def test_a_dead_or_exiting_rank_is_not_silent() -> None:
    watch = StallWatch(60, 1)
    for t in range(40):
        beats = {0: beat(t, step=t), 1: beat(0, step=0), 2: beat(0, phase="exit")}
        assert watch.observe(float(t), beats, {0: True, 1: False, 2: True}) is None


def test_frames_count_only_where_there_is_nothing_else_to_count() -> None:
    def at(n: int, phase: str) -> Heartbeat:
        pgs = [{"pg": "0", "enqueued": 3, "completed": 3}] if phase == "running" else []
        return beat(n, phase=phase, stack=[["/w/prog.py", n, "f"]], pgs=pgs)

    importing = StallWatch(10, 1)
    spinning = StallWatch(10, 1)
    found = []
    for t in range(30):
        assert importing.observe(float(t), {0: at(t, "start")}, {0: True}) is None
        if spinning.observe(float(t), {0: at(t, "running")}, {0: True}) is not None:
            found.append(t)
    assert found == [10]


def test_cpu_time_counts_before_init() -> None:
    """Loading libtorch holds one frame for seconds; the main thread's CPU time still moves.
    A rank sleeping before init moves neither."""
    def at(n: int, cpu: float) -> Heartbeat:
        return beat(n, phase="start", stack=[["/w/torch/__init__.py", 290, "<module>"]],
                    main_cpu_s=cpu)

    loading, sleeping = StallWatch(10, 1), StallWatch(10, 1)
    found = []
    for t in range(30):
        assert loading.observe(float(t), {0: at(t, 0.5 * t)}, {0: True}) is None
        if sleeping.observe(float(t), {0: at(t, 1.25)}, {0: True}) is not None:
            found.append(t)
    assert found == [10]


def test_without_the_flight_recorder_frames_stand_in() -> None:
    """TORCH_FR_BUFFER_SIZE=0 leaves no counters; a program without steps then progresses
    when its innermost frame moves (a real run: test_diag_sidecar's recorder-off test)."""
    def at(n: int, line: int) -> Heartbeat:
        return beat(n, phase="running", stack=[["/w/prog.py", line, "f"]], pgs=[])

    moving, stuck = StallWatch(10, 1), StallWatch(10, 1)
    for t in range(30):
        assert moving.observe(float(t), {0: at(t, t)}, {0: True}) is None
        found = stuck.observe(float(t), {0: at(t, 5)}, {0: True})
        assert found is None or t == 10
        if found is not None:
            break
    assert found is not None and found.reason == "no_progress"


# --- stacks and frames ---------------------------------------------------------------------


def test_parse_stacks_takes_the_main_thread() -> None:
    text = load("train")["dumps"][1]["stacks"]
    frames, stdlib = parse_stacks(text)
    assert stdlib is not None and stdlib.endswith("python3.11")
    assert frames[0] == Frame("/REPO/tests/diag/programs/stuck_data.py", 32, "__getitem__")
    assert frames[-1].function == "_run_module_as_main"
    assert innermost_user_frame(frames, stdlib) == frames[0]
    # orchestrate's own frames come second, library frames last
    inner = [f for f in frames if "dataloader.py" in f.file or "trainer.py" in f.file]
    assert innermost_user_frame(inner, stdlib) == next(f for f in inner if "trainer" in f.file)
    # without the header: the first thread that is not the dumping one
    bare = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    assert parse_stacks(bare)[0] == frames


@pytest.mark.parametrize(("path", "kind"), [
    ("/home/u/proj/train.py", "user"),
    ("/usr/lib/python3.10/threading.py", "library"),
    ("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", "library"),
    ("/usr/lib/python3/dist-packages/numpy/core.py", "library"),
    ("<frozen runpy>", "library"),
    ("/tmp/site/sitecustomize.py", "library"),
    ("/src/torch/distributed/distributed_c10d.py", "library"),
    ("/work/orchestrate/train/trainer.py", "ours"),
    ("/work/orchestrate/sidecar.py", "ours"),
    ("/runs/j-1/sidecar/_orchestrate_rank/sidecar.py", "library"),
])
def test_frame_kinds(path: str, kind: str) -> None:
    assert frame_kind(path) == kind


def test_format_ranks() -> None:
    assert format_ranks([]) == ""
    assert format_ranks([3]) == "3"
    assert format_ranks([4, 0, 1, 2]) == "0-2,4"
    assert format_ranks([0, 2, 4, 5, 6, 9]) == "0,2,4-6,9"


# --- Python 3.8: the node's python in a Slurm batch script -----------------------------------


@pytest.mark.process
def test_classifier_on_python38(tmp_path: Path) -> None:
    python = _python38()
    if python is None:
        pytest.skip("no Python 3.8 interpreter here")
    script = f"""
import json, sys
sys.path.insert(0, {str(REPO)!r})
from orchestrate.diagnosis.diagfiles import Answer, Heartbeat
from orchestrate.diagnosis.stall import Diagnosis, classify
from orchestrate.diagnosis.stallrule import Stall, StallWatch
from orchestrate.diagnosis import activation, evidence, hangwatch, ranktable, sidecar
out = {{}}
for name in {NAMES!r}:
    d = json.load(open({str(CAPTURES)!r} + "/" + name + ".json"))
    stall = Stall.from_json(d["stall"])
    diag = classify({{int(r): Heartbeat.from_json(b) for r, b in d["heartbeats"].items()}},
                    {{int(r): Answer.from_json(x) for r, x in d["dumps"].items()}}, d["now"],
                    {{int(r): n for r, n in d["nodes"].items()}}, d["master"], "lo", stall=stall)
    out[name] = diag.to_json()
print(json.dumps(out))
"""
    proc = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=120,
                          env={"PATH": os.environ.get("PATH", "")})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for name in NAMES:
        assert got[name] == run_classify(load(name)).to_json()


@pytest.mark.process
def test_sidecar_as_sitecustomize_on_python38_without_torch(tmp_path: Path) -> None:
    python = _python38()
    if python is None:
        pytest.skip("no Python 3.8 interpreter here")
    site = install_site(tmp_path / "site")
    run = tmp_path / "run"
    proc = subprocess.run(
        [python, "-c", "import time; time.sleep(1.5); print('ok')"],
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(site), "RANK": "4",
             "ORCHESTRATE_RUN_DIR": str(run), "ORCHESTRATE_HEARTBEAT_S": "0.2",
             "ORCHESTRATE_TIMEOUT_S": "30"},
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout == "ok\n" and proc.stderr == ""
    beat = json.loads((run / "diag" / "hb" / "rank-4.json").read_text())
    assert beat["phase"] == "exit" and beat["rank"] == 4 and beat["beat"] >= 3
    assert beat["pgs"] is None and beat["fr"] == "off"


def test_capture_edits_do_not_leak() -> None:
    """The loader returns fresh copies (the variants above edit them)."""
    first = load("mismatch")
    edited = copy.deepcopy(first)
    _pg0(edited, 2)["op"] = "all_reduce"
    assert _pg0(load("mismatch"), 2)["op"] == "barrier"
