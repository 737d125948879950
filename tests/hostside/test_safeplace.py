"""Safe places to write and execute (hostside/safeplace.py, issue #32): one test per rule, on
real folders. Who owns a folder is set with chown (root only: skipped otherwise); the attack by
a real second user, through the CLI, is in tests/backends/local/test_local_places.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from orchestrate.hostside import safeplace
from orchestrate.hostside.safeplace import Unsafe, UnsafePlace

pytestmark = pytest.mark.unit

OTHER = 54321  # a uid no one has: "another user"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _refused(path: Path, script: str | None = None) -> Unsafe:
    with pytest.raises(UnsafePlace) as caught:
        if script is None:
            safeplace.write_tree(path, {"launch-n.sh": "echo mine\n"})
        else:
            safeplace.runnable(path, script)
    assert str(caught.value) == caught.value.unsafe.message()
    return caught.value.unsafe


def test_a_run_dir_is_made_private_through_held_folders(tmp_path: Path) -> None:
    run_dir = tmp_path / "a" / "runs" / "job1"
    safeplace.write_tree(run_dir, {"launch-n.sh": "echo mine\n", "plan.json": "{}",
                                   "sidecar/_orchestrate_rank/x.py": "x = 1\n"})
    assert _mode(tmp_path / "a") == 0o755 and _mode(tmp_path / "a" / "runs") == 0o755
    assert _mode(run_dir) == 0o700 and _mode(run_dir / "sidecar") == 0o700
    assert _mode(run_dir / "sidecar" / "_orchestrate_rank") == 0o700
    assert _mode(run_dir / "launch-n.sh") == 0o700 and _mode(run_dir / "plan.json") == 0o600
    assert sorted(p.name for p in run_dir.iterdir()) == ["launch-n.sh", "plan.json", "sidecar"]
    assert (run_dir / "sidecar/_orchestrate_rank/x.py").read_text() == "x = 1\n"
    # Written again (a restart): replaced in place, still private, no temporary file left.
    safeplace.write_tree(run_dir, {"launch-n.sh": "echo again\n"})
    assert (run_dir / "launch-n.sh").read_text() == "echo again\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["launch-n.sh", "plan.json", "sidecar"]
    assert safeplace.runnable(run_dir, "launch-n.sh", ("sidecar",)) == str(run_dir /
                                                                           "launch-n.sh")


@pytest.mark.parametrize("mode", [0o775, 0o2775, 0o757, 0o777])
def test_a_folder_above_that_others_may_write_is_refused_with_its_owner_mode_and_fix(
        tmp_path: Path, mode: int) -> None:
    project = tmp_path / "project"
    project.mkdir()
    project.chmod(mode)
    unsafe = _refused(project / "runs" / "job1")
    assert unsafe.folder == str(project) and unsafe.mode == f"{mode:04o}"
    assert unsafe.owner.split(":")[0] in (str(os.geteuid()), os.environ.get("USER", "root"),
                                          "root")
    assert ("every user" if mode & 0o002 else "writable by group") in unsafe.problem
    fix = "chmod +t" if os.geteuid() == 0 else "chmod go-w"
    assert fix in unsafe.fix and "ORCHESTRATE_RUNS" in unsafe.fix
    assert not (project / "runs").exists()  # nothing was made below it


@as_root
def test_a_folder_above_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER, OTHER)
    unsafe = _refused(theirs / "job1")
    assert unsafe.folder == str(theirs) and unsafe.owner == f"{OTHER}:{OTHER}"
    assert unsafe.mode == "0755" and f"belongs to {OTHER}" in unsafe.problem


@as_root
def test_a_sticky_folder_is_safe_only_when_root_owns_it(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # root's, like /tmp
    safeplace.write_tree(shared / "runs" / "job1", {"launch-n.sh": "echo mine\n"})
    assert safeplace.runnable(shared / "runs" / "job1", "launch-n.sh")
    os.chown(shared, OTHER, OTHER)  # sticky, but its owner may rename anything in it
    unsafe = _refused(shared / "runs" / "job1", "launch-n.sh")
    assert unsafe.folder == str(shared) and unsafe.mode == "1777"


def test_a_symlink_on_the_way_is_followed_and_its_target_checked(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    safeplace.write_tree(tmp_path / "link" / "job1", {"launch-n.sh": "echo mine\n"})
    assert (real / "job1" / "launch-n.sh").exists()
    real.chmod(0o777)  # the folder the link leads to is what others could swap
    unsafe = _refused(tmp_path / "link" / "job1", "launch-n.sh")
    assert unsafe.folder == str(real) and unsafe.mode == "0777"


@as_root
def test_a_symlink_of_another_user_on_the_way_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, OTHER, OTHER)
    unsafe = _refused(link / "job1")
    assert unsafe.folder == str(link) and f"symbolic link of {OTHER}" in unsafe.problem


def test_an_existing_run_dir_must_be_your_own_private_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "job1"
    run_dir.mkdir(mode=0o750)
    run_dir.chmod(0o750)
    unsafe = _refused(run_dir)
    assert unsafe.folder == str(run_dir) and unsafe.mode == "0750"
    assert unsafe.fix == f"chmod 700 {run_dir}"
    linked = tmp_path / "job2"
    linked.symlink_to(tmp_path)  # a run dir is a folder, never a link to one
    assert _refused(linked).folder == str(linked)


@as_root
def test_a_run_dir_or_script_of_another_user_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "job1"
    safeplace.write_tree(run_dir, {"launch-n.sh": "echo mine\n"})
    os.chown(run_dir / "launch-n.sh", OTHER, OTHER)  # planted: not run
    unsafe = _refused(run_dir, "launch-n.sh")
    assert unsafe.folder == str(run_dir / "launch-n.sh") and "not run" in unsafe.problem
    os.chown(run_dir, OTHER, OTHER)
    unsafe = _refused(run_dir)
    assert unsafe.folder == str(run_dir) and "remove it" in unsafe.fix


def test_a_script_others_may_write_is_not_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "job1"
    safeplace.write_tree(run_dir, {"launch-n.sh": "echo mine\n"})
    (run_dir / "launch-n.sh").chmod(0o777)
    assert _refused(run_dir, "launch-n.sh").mode == "0777"


def test_a_folder_renamed_after_the_write_fails_the_check_before_the_run(tmp_path: Path) -> None:
    """The labmate's move: the run dir's parent renamed away and another put in its place,
    between the write and the exec. The re-check walks the path the script would run from."""
    runs = tmp_path / "runs"
    safeplace.write_tree(runs / "job1", {"launch-n.sh": "echo mine\n"})
    runs.rename(tmp_path / "runs.old")
    (runs / "job1").mkdir(parents=True, mode=0o755)  # not a private run dir: refused
    (runs / "job1" / "launch-n.sh").write_text("echo planted\n")
    unsafe = _refused(runs / "job1", "launch-n.sh")
    assert unsafe.folder == str(runs / "job1") and unsafe.mode == "0755"


def test_the_refusal_crosses_the_agent_channel_as_a_typed_record() -> None:
    unsafe = Unsafe("/proj", "root:lab", "2775", "is writable by group lab", "chmod +t /proj")
    reply = safeplace.refusal(UnsafePlace(unsafe))
    assert reply["ok"] is False and "chmod +t /proj" in reply["detail"]
    assert safeplace.optional_unsafe(reply) == unsafe
    assert Unsafe.from_json(unsafe.to_json()) == unsafe
