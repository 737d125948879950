"""The sidecar inside real processes: phases, heartbeat format, dumps on request, children,
chained sitecustomize, write failures, exit, and the default-timeout bound."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrate.core import layout
from orchestrate.core.plan.outcome import Exit, Failure, RankEnd
from orchestrate.diagnosis import evidence, rankpackage, sidecar
from orchestrate.diagnosis.diagfiles import DiagFiles
from orchestrate.hostside.shipping import module_source
from orchestrate.run.logsink import last_lines
from tests.support.diagranks import PROGRAMS, REPO, Job, Starter, install_site

pytestmark = [pytest.mark.process, pytest.mark.torch]


def _single(starter: Starter, code: str, *, name: str, env: dict[str, str] | None = None,
            python: str = sys.executable, heartbeat_s: float = 0.2) -> tuple:  # type: ignore[type-arg]
    job = starter.start([python, "-c", code], 1, name=name, env=env, heartbeat_s=heartbeat_s)
    return job, job.procs[0]


def _wait_file(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.unit
def test_file_names_match_the_layout() -> None:
    """The sidecar writes where every reader looks: one DiagFiles, built on the layout's names,
    on both sides."""
    run = Path("/r")
    files = DiagFiles(run)
    assert (files.folder, files.heartbeats, files.request) == (
        run / layout.DIAG_DIR, run / layout.HEARTBEAT_DIR, run / layout.DIAG_DIR / "request"
    )
    assert files.heartbeat(3) == run / "diag" / "hb" / "rank-3.json"
    car = sidecar.Sidecar(str(run), 3, 1.0)  # not launched: no thread, no files
    assert car._hb_path == str(files.heartbeat(3)) and car.files == files
    answer = files.answer("r-1", 3)
    assert [p.name for p in (answer.stacks, answer.state, answer.flight_recorder, answer.done)] == [
        "rank-3.stacks.txt", "rank-3.state.json", "rank-3.fr.json", "rank-3.done"]


def test_the_sidecar_folder_carries_the_same_modules_privately() -> None:
    """The copies in _orchestrate_rank/ are orchestrate's modules, their imports of one another
    pointed at the private package; nothing there imports orchestrate (the user's own
    installed one could be another version)."""
    files = rankpackage.folder()
    names = {m: f"_orchestrate_rank/{m.__name__.rsplit('.', 1)[1]}.py"
             for m in rankpackage.SIDECAR.modules}
    assert sorted(files) == sorted(
        ["sitecustomize.py", "_orchestrate_rank/__init__.py", "orchestrate_steps.py",
         *names.values()])
    assert len(files["sitecustomize.py"].splitlines()) <= 12
    for module, name in names.items():
        copy = files[name]
        assert not re.search(r"^\s*(from|import) orchestrate\b", copy, re.M), name
        for before, after in zip(module_source(module).splitlines(), copy.splitlines(),
                                 strict=True):  # only the import lines differ
            if before != after:
                assert re.sub(r"from orchestrate\.(\w+\.)*(\w+) import",
                              r"from _orchestrate_rank.\2 import", before) == after, before
    with pytest.raises(ValueError, match="does not carry"):
        rankpackage.carried(evidence, rankpackage.SIDECAR)


@pytest.mark.timing
def test_phases_and_heartbeat_of_a_plain_program(starter: Starter) -> None:
    job = starter.start([sys.executable, str(PROGRAMS / "phases.py")], 2, name="phases",
                        heartbeat_s=0.1)
    seen: list[str] = []
    beats: list[int] = []
    last = None
    deadline = time.monotonic() + 120
    while job.alive()[0] and time.monotonic() < deadline:
        beat = evidence.read_heartbeats(job.run_dir, [0])[0]
        if beat is not None:
            last = beat
            beats.append(beat.beat)
            if not seen or seen[-1] != beat.phase:
                seen.append(beat.phase)
        time.sleep(0.03)
    assert job.wait(30) == {0: 0, 1: 0}, job.output()
    last = evidence.read_heartbeats(job.run_dir, [0])[0]
    assert last is not None
    if seen[-1] != last.phase:
        seen.append(last.phase)
    assert seen == ["start", "init_process_group", "running", "finished", "exit"], seen
    assert beats == sorted(beats)
    assert last.rank == 0 and last.pid == job.procs[0].pid
    assert last.host == socket.gethostname()
    assert last.step is None and last.fr == "ok" and last.interval_s == 0.1
    # 20 all_reduces on the default group, all completed, as the flight recorder counts them
    assert [(p.pg, p.enqueued, p.completed) for p in last.pgs or ()] == [("0", 20, 20)]
    assert last.pgs is not None
    assert last.t is not None and last.phase_since is not None and last.started is not None
    assert last.t >= last.phase_since >= last.started
    # exiting is not held up by the thread
    end = float((job.marks / "end-0").read_text())
    assert last.t - end < 1.0
    # the file holds exactly what the record says (nothing lost on the way)
    raw = json.loads((job.run_dir / "diag" / "hb" / "rank-0.json").read_text())
    assert raw == last.to_json()


def test_recorder_off_is_said_not_guessed(starter: Starter) -> None:
    job = starter.start([sys.executable, str(PROGRAMS / "phases.py")], 2, name="fr-off",
                        env={"TORCH_FR_BUFFER_SIZE": "0"}, heartbeat_s=0.2)
    deadline = time.monotonic() + 120
    running = None
    while job.alive()[0] and time.monotonic() < deadline and running is None:
        beat = evidence.read_heartbeats(job.run_dir, [0])[0]
        if beat is not None and beat.phase == "running":
            running = beat
        time.sleep(0.05)
    assert job.wait(60) == {0: 0, 1: 0}, job.output()
    assert running is not None
    assert running.pgs == () and running.fr == "empty"


@pytest.mark.timing
def test_thread_never_delays_exit(starter: Starter, tmp_path: Path) -> None:
    end = tmp_path / "end"
    code = f"import time; time.sleep(1.0); open({str(end)!r}, 'w').write(str(time.time()))"
    job, proc = _single(starter, code, name="quick", heartbeat_s=30)
    proc.wait(timeout=60)
    exited = time.time()
    assert proc.returncode == 0
    assert exited - float(end.read_text()) < 0.5
    beat = evidence.read_heartbeats(job.run_dir, [0])[0]
    assert beat is not None and beat.phase == "exit" and beat.pgs is None
    assert beat.fr == "off"  # torch was never imported, and the sidecar did not import it
    assert "torch" not in json.dumps([frame.to_json() for frame in beat.stack])


def test_a_run_dir_that_refuses_files_costs_one_line(starter: Starter) -> None:
    code = "import time; time.sleep(2); print('done')"
    blocked = starter.tmp / "blocked"
    blocked.mkdir()
    (blocked / "diag").write_text("not a folder")
    proc = subprocess.run(
        [sys.executable, "-c", code], env={
            **{k: v for k, v in os.environ.items() if k != "ORCHESTRATE_SIDECAR_PID"},
            "PYTHONPATH": str(starter.site), "RANK": "0", "ORCHESTRATE_RUN_DIR": str(blocked),
        }, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout == "done\n"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("orchestrate sidecar: rank 0: cannot create "), (
        proc.stderr
    )


def test_losing_the_folder_mid_run_stops_the_sidecar_with_one_line(starter: Starter) -> None:
    code = "import time; time.sleep(4); print('done')"
    job, proc = _single(starter, code, name="lost", heartbeat_s=0.1)
    hb = job.run_dir / "diag" / "hb"
    _wait_file(hb / "rank-0.json")
    for child in hb.iterdir():
        child.unlink()
    hb.rmdir()
    hb.write_text("no longer a folder")
    proc.wait(timeout=60)
    output = job.output()
    assert proc.returncode == 0 and "done" in output
    sidecar_lines = [ln for ln in output.splitlines() if ln.startswith("orchestrate sidecar:")]
    assert len(sidecar_lines) == 1 and "cannot write" in sidecar_lines[0], output


@pytest.mark.timing
def test_dump_on_request_and_stale_requests(starter: Starter) -> None:
    code = "import time\ndef wait():\n    time.sleep(30)\nwait()"
    diag = starter.tmp / "asked" / "diag"
    diag.mkdir(parents=True)
    (diag / "request").write_text(json.dumps({"id": "old", "t": time.time() - 3600}))
    job = starter.start([sys.executable, "-c", code], 1, name="asked-run",
                        env={"ORCHESTRATE_RUN_DIR": str(starter.tmp / "asked")})
    _wait_file(diag / "hb" / "rank-0.json")
    time.sleep(1.5)
    assert not (diag / "old").exists(), "a request from an earlier run was answered"
    collected = evidence.collect(starter.tmp / "asked", [0], timeout_s=10)
    answer = collected.answers[0]
    assert collected.silent == [] and answer is not None
    assert collected.waited_s < 3
    assert answer.stacks is not None
    assert answer.stacks.startswith("# orchestrate sidecar: rank 0 pid ")
    assert '  File "<string>", line 3 in wait' in answer.stacks
    assert answer.state is not None and answer.state.proc is not None
    assert answer.state.proc.state == "S"
    names = sorted(Path(f).name for f in answer.files)
    assert names == ["rank-0.stacks.txt", "rank-0.state.json"]  # no torch: no flight recorder
    job.procs[0].send_signal(signal.SIGSTOP)
    job.stopped.add(0)
    again = evidence.collect(starter.tmp / "asked", [0], timeout_s=2)
    assert again.silent == [0] and again.answers == {0: None}


def test_spawned_children_stay_off_and_other_sitecustomize_still_runs(
    starter: Starter, tmp_path: Path
) -> None:
    other = tmp_path / "debian-like"
    other.mkdir()
    (other / "sitecustomize.py").write_text(
        "import os\nos.environ['CHAINED_SITECUSTOMIZE'] = 'yes'\n"
    )
    job = starter.start([sys.executable, str(PROGRAMS / "child.py")], 1, name="child",
                        python_path=[other])
    assert job.wait(90) == {0: 0}, job.output()
    report = json.loads(job.output().splitlines()[-1])
    parent = job.procs[0].pid
    assert report["parent"] == {"pid": parent, "sidecar": True, "owner": str(parent)}
    assert report["child"]["sidecar"] is False and report["child"]["owner"] == str(parent)
    assert report["child"]["pid"] != parent
    assert report["chained"] == "yes"
    beat = evidence.read_heartbeats(job.run_dir, [0])[0]
    assert beat is not None and beat.pid == parent


def test_one_sidecar_when_both_copies_start_it(starter: Starter) -> None:
    """A trainer under the launcher's sitecustomize: orchestrate.diagnosis.sidecar.start() finds the
    sidecar the sitecustomize copy started, and phase() drives it."""
    code = (
        "import sys, threading, time\n"
        "from orchestrate.diagnosis import sidecar\n"
        "car = sidecar.start(sys.argv[1], 0)\n"
        "assert car is getattr(sys, '_orchestrate_sidecar')\n"
        "assert type(car).__module__ == '_orchestrate_rank.sidecar'\n"
        "sidecar.phase('step', 3)\n"
        "time.sleep(1.0)\n"
        "print(sum(t.name == 'orchestrate-sidecar' for t in threading.enumerate()))\n"
    )
    job = starter.start([sys.executable, "-c", code, str(starter.tmp / "both")], 1,
                        name="both", python_path=[REPO], heartbeat_s=0.1,
                        env={"ORCHESTRATE_RUN_DIR": str(starter.tmp / "both")})
    assert job.wait(60) == {0: 0}, job.output()
    assert job.output().strip().splitlines()[-1] == "1"
    beats = evidence.read_heartbeats(starter.tmp / "both", [0])
    assert beats[0] is not None and (beats[0].phase, beats[0].step) == ("exit", 3)


def test_switch_off(starter: Starter) -> None:
    job, proc = _single(starter, "print('hi')", name="off", env={"ORCHESTRATE_SIDECAR": "0"})
    proc.wait(timeout=60)
    assert proc.returncode == 0
    assert not (job.run_dir / "diag").exists()


# --- ORCHESTRATE_TIMEOUT_S bounds torch.distributed's default timeout ------------------------


def _timeout_job(starter: Starter, name: str, env: dict[str, str]) -> tuple:  # type: ignore[type-arg]
    job = starter.start(
        [sys.executable, str(PROGRAMS / "timeout.py")], 2, name=name,
        env={"ORCHESTRATE_SIDECAR": "0", **env},
    )
    codes = job.wait(120)
    return job, codes


@pytest.mark.timing
def test_default_timeout_becomes_the_jobs(starter: Starter) -> None:
    job, codes = _timeout_job(starter, "bounded", {"ORCHESTRATE_TIMEOUT_S": "5"})
    out = job.output()
    assert codes == {0: 3, 1: 3}, out
    assert out.count("default 5.0") == 2
    # Both ranks wait 5 s; the first to time out exits, and on a busy machine its peer can see
    # the connection close just before its own 5 s are up (run C2): a rank ends by the bound
    # or by its peer's end after it, never later than the bound allows.
    failures = [line for line in out.splitlines() if line.startswith("failed after")]
    assert out.count("Timed out waiting 5000ms") >= 1, out
    assert all("Timed out waiting 5000ms" in line or "Connection closed by peer" in line
               for line in failures), out
    took = [float(line.split()[2]) for line in failures]
    assert len(took) == 2 and all(4.5 <= t <= 30 for t in took), took
    assert not (job.run_dir / "diag").exists()  # the bound does not need the sidecar


def _ending(job: Job, rank: int, code: int) -> str:
    """The sentence a launcher says of a rank that ended so (core.plan.outcome.Failure)."""
    end = Exit(signal=-code) if code < 0 else Exit(code=code)
    failure = Failure.of(RankEnd(rank, "local", end, 0.0), last_lines(job.logs[rank], 10))
    return failure.sentence()


def test_explicit_timeout_wins(starter: Starter) -> None:
    """Both ranks time out after 3 s. How each process then ends is the runtime's: the program
    exits 3, or gloo's teardown aborts it (SIGABRT, issue #25 item 14): either way the ending
    names the timeout."""
    job, codes = _timeout_job(
        starter, "explicit", {"ORCHESTRATE_TIMEOUT_S": "60", "EXPLICIT_TIMEOUT_S": "3"}
    )
    out = job.output()
    # The first to time out exits; on a busy machine its peer can see the connection close just
    # before its own 3 s are up (as in test_default_timeout_becomes_the_jobs; CI rehearsal of
    # stop 46): a rank names the timeout, or its peer's close after it, never anything else.
    timed_out = [r for r in codes if "Timed out waiting 3000ms" in job.logs[r].read_text()]
    assert timed_out, out
    for rank, code in codes.items():
        assert code in (3, -signal.SIGABRT), out
        if rank in timed_out:
            assert _ending(job, rank, code).startswith(
                f"rank {rank} on local: collective timed out after 3 s (it then ended with "), out
        else:
            assert "Connection closed by peer" in job.logs[rank].read_text(), out


def test_a_timeout_is_named_when_the_rank_then_aborts(starter: Starter) -> None:
    """Rank 0 dies of SIGABRT right after its collective timed out: not "failed with signal
    6", but the timeout, and then the signal."""
    job, codes = _timeout_job(
        starter, "aborted",
        {"ORCHESTRATE_TIMEOUT_S": "60", "EXPLICIT_TIMEOUT_S": "3", "ABORT_RANK": "0"},
    )
    assert codes[0] == -signal.SIGABRT, job.output()
    assert _ending(job, 0, codes[0]) == (
        "rank 0 on local: collective timed out after 3 s (it then ended with signal 6 "
        "(SIGABRT))")


@pytest.mark.timing
def test_rendezvous_wait_is_bounded_too(starter: Starter) -> None:
    job = starter.start(
        [sys.executable, str(PROGRAMS / "timeout.py")], 2, name="alone",
        env={"ORCHESTRATE_SIDECAR": "0", "ORCHESTRATE_TIMEOUT_S": "5", "NEVER_JOIN_RANK": "1"},
    )
    deadline = time.monotonic() + 90
    while job.alive()[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    out = job.output()
    assert job.procs[0].poll() == 3, out
    took = [float(line.split()[2]) for line in out.splitlines() if line.startswith("failed after")]
    assert len(took) == 1 and 4.5 <= took[0] <= 40, out


def test_without_the_sitecustomize_torch_keeps_its_30_minutes(tmp_path: Path) -> None:
    code = "import torch.distributed as d; print(d.distributed_c10d.default_pg_timeout)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    plain = subprocess.run([sys.executable, "-c", code], env={**env, "ORCHESTRATE_TIMEOUT_S": "5"},
                           capture_output=True, text=True, timeout=120)
    assert plain.stdout.strip() == "0:30:00"
    site = install_site(tmp_path / "site")
    hooked = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "ORCHESTRATE_TIMEOUT_S": "5", "PYTHONPATH": str(site)},
        capture_output=True, text=True, timeout=120,
    )
    assert hooked.stdout.strip() == "0:00:05", hooked.stderr


_LEFT_STANDING = """
import atexit, os, sys, torch, torch.distributed as dist
marks = os.environ["MARKS"]
def look():  # registered before the join: runs after orchestrate's own exit handler
    with open(os.path.join(marks, "rank-" + os.environ["RANK"]), "w") as out:
        out.write(str(dist.is_initialized()))
atexit.register(look)
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == float(os.environ["WORLD_SIZE"])
"""


def test_a_gloo_world_the_program_left_standing_is_destroyed_before_python_ends(
        starter: Starter) -> None:
    """A program that never calls destroy_process_group (Lightning's Trainer.fit) left gloo's
    threads to be torn down with the interpreter: SIGABRT ``terminate called without an active
    exception`` in a rank whose training succeeded (CI, stop 41). The sidecar destroys that
    world at exit; without the sidecar the same program still has it at exit."""
    ours = starter.start([sys.executable, "-c", _LEFT_STANDING], 2, name="tidied")
    bare = starter.start([sys.executable, "-c", _LEFT_STANDING], 2, name="bare", site=False)
    for job in (ours, bare):
        statuses = job.wait(120)
        # The bare world may abort at teardown (the bug itself); ours must end cleanly.
        if job is ours:
            assert statuses == {0: 0, 1: 0}, job.output()
    assert [(ours.marks / f"rank-{r}").read_text() for r in (0, 1)] == ["False", "False"]
    assert [(bare.marks / f"rank-{r}").read_text() for r in (0, 1)] == ["True", "True"]


_MODEL_LEFT_IN_A_CYCLE = """
import os, weakref, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
marks = os.environ["MARKS"]
dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Linear(4, 1))
model(torch.ones(2, 4)).sum().backward()
def freed(_):  # whether the world still held the group when the model (its reducer) went
    with open(os.path.join(marks, "freed-" + os.environ["RANK"]), "w") as out:
        out.write(str(dist.is_initialized()))
watch = weakref.ref(model, freed)
cycle = {"model": model}
cycle["self"] = cycle  # garbage once the names go: freed only by the collector
del model, cycle
"""


def test_a_ddp_model_left_in_a_cycle_goes_before_the_world_it_holds(starter: Starter) -> None:
    """Destroyed while a DDP model lives, the group's last owner is the model's reducer, whose
    release joins gloo's threads holding the GIL (pytorch/pytorch#56297: a hang after the
    program's end, every Fabric case on Slurm once). The exit handler collects the garbage
    first: the model goes while the world still holds the group, and the ranks end."""
    job = starter.start([sys.executable, "-c", _MODEL_LEFT_IN_A_CYCLE], 2, name="cycle")
    assert job.wait(120) == {0: 0, 1: 0}, job.output()
    assert [(job.marks / f"freed-{r}").read_text() for r in (0, 1)] == ["True", "True"]
