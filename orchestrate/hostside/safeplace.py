"""Safe places to write and execute: a job's run directory, its sidecar folder and its scripts,
made and checked so that no other user can swap what their paths name.

Why: a run directory is private (0700), but its path runs through folders above it. In a group
project folder (``2775 root:lab``, the usual layout) any member may rename the victim's
``runs/`` (or the new run dir) and put a folder of his own in its place, with his own
``launch-*.sh`` or ``sitecustomize.py``: the victim's job would then run his code as the victim.
So before anything is written or executed there, every folder on the way is checked
(:func:`check_folder`):

- owned by root or by the user (a folder of another user is his to rename or empty);
- writable by no one else (no group or other write bit), unless it is sticky *and* owned by
  root, as ``/tmp`` and ``/var/tmp`` are: there nobody may rename what is not his;
- a symbolic link on the way is followed only when root or the user owns it (its folder was
  checked, so nobody else can replace it), and the folders of its target are checked too;
- the run directory itself, when it exists, is the user's own 0700 folder; made here, it is.

Otherwise :class:`UnsafePlace` names the folder, its owner and mode, and the fix (the CLI makes
it a user error: exit 2). Nothing is checked by name and then used by name: the walk opens each
folder relative to the one before (``os.open(name, O_NOFOLLOW | O_DIRECTORY, dir_fd=...)``) and
checks the folder it holds (``fstat``); new folders are made with ``mkdir(dir_fd=...)``; a file
is written to an unguessable temporary name (``O_CREAT | O_EXCL | O_NOFOLLOW``) and renamed
inside the held folder.

**Executing what was written.** A script runs by its path (``bash RUN_DIR/launch-<node>.sh``:
its ``$0`` is used again by the container guard). So right before the exec, :func:`runnable`
walks the whole path again through directory descriptors and checks the script: a regular file
of the user's, writable by nobody else, in the user's 0700 run directory. Once that holds, only
the user and root can change anything the path resolves through, so ``bash`` opens the file
that was checked; a folder above renamed between the write and the exec fails that re-check,
naming the folder. (Holding the script's descriptor for ``bash /dev/fd/N`` would change ``$0``.)

Standard library only, Python 3.8+: the SSH agent carries it to every host.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import sys
from dataclasses import dataclass

TYPE_CHECKING = False  # typing costs milliseconds per start; the agent starts once per rank
if TYPE_CHECKING:
    from typing import Any, Mapping

#: How many symbolic links one walk follows (the kernel's own limit).
MAX_LINKS = 40
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Where runs may live: the fix every refusal of a folder above the run directory ends with.
ELSEWHERE = ("or set run_root (or $ORCHESTRATE_RUNS) to a folder of your own, e.g. ~/runs "
             "(docs/shared-servers.md, \"Where runs may live\")")


@dataclass(frozen=True)
class Unsafe:
    """Why a place is refused: the folder, its owner and mode (octal), what is wrong, the fix.
    Crosses the SSH agent's channel as JSON."""

    folder: str
    owner: str
    mode: str
    problem: str
    fix: str

    def message(self) -> str:
        """One line: the folder, its owner and mode, and what is wrong."""
        return f"{self.folder} (owner {self.owner}, mode {self.mode}) {self.problem}"

    def to_json(self) -> dict[str, str]:
        return {"folder": self.folder, "owner": self.owner, "mode": self.mode,
                "problem": self.problem, "fix": self.fix}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Unsafe:
        return cls(*(str(data[k]) for k in ("folder", "owner", "mode", "problem", "fix")))


class UnsafePlace(Exception):
    """A place where another user could swap what a path names (:class:`Unsafe` says which)."""

    def __init__(self, unsafe: Unsafe) -> None:
        super().__init__(unsafe.message())
        self.unsafe = unsafe


def _name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def _group(gid: int) -> str:
    try:
        import grp

        return grp.getgrgid(gid).gr_name
    except (KeyError, ImportError):
        return str(gid)


def _unsafe(where: str, st: os.stat_result, problem: str, fix: str) -> UnsafePlace:
    owner = f"{_name(st.st_uid)}:{_group(st.st_gid)}"
    return UnsafePlace(Unsafe(where, owner, f"{stat.S_IMODE(st.st_mode):04o}", problem, fix))


def check_folder(st: os.stat_result, where: str, me: int) -> None:
    """A folder on the way to a run directory: root's or ``me``'s, and writable by nobody else
    unless sticky and root's (``/tmp``)."""
    if st.st_uid not in (0, me):
        raise _unsafe(where, st, f"belongs to {_name(st.st_uid)}, who may rename or replace "
                      "what is in it", "keep runs out of other users' folders, " + ELSEWHERE)
    writers = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if not writers or (st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        return
    who = "every user" if st.st_mode & stat.S_IWOTH else f"group {_group(st.st_gid)}"
    problem = (f"is writable by {who}: any of them may rename what is in it and put a folder of "
               "their own, with their own scripts, in its place")
    if st.st_uid == 0:
        fix = (f"ask root to make it sticky (chmod +t {where}: then nobody may rename what is "
               "not theirs), " + ELSEWHERE)
    else:
        fix = f"chmod go-w {where}, " + ELSEWHERE
    raise _unsafe(where, st, problem, fix)


def _check_own(st: os.stat_result, where: str, me: int, what: str) -> None:
    """The run directory (or a folder in it): ``me``'s own, and 0700."""
    if (st.st_uid != me or not stat.S_ISDIR(st.st_mode)
            or stat.S_IMODE(st.st_mode) & 0o777 != 0o700):
        fix = (f"chmod 700 {where}" if st.st_uid == me and stat.S_ISDIR(st.st_mode) else
               "remove it (or choose another job id or run_root): orchestrate writes only into "
               "a run directory of your own")
        raise _unsafe(where, st, f"is not your own private folder (0700), as {what} must be",
                      fix)


class Folder:
    """A folder held open by descriptor after its whole path was checked; what is made or
    written in it is made relative to that descriptor."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def folder(self, name: str, create: bool = True,
               what: str = "a folder of the run directory") -> Folder:
        """A private folder in this one (made 0700 when missing), held open."""
        where = os.path.join(self.path, name)
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=self.fd)
        st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            _check_own(st, where, os.geteuid(), what)
        fd = os.open(name, _DIR, dir_fd=self.fd)
        try:
            _check_own(os.fstat(fd), where, os.geteuid(), what)
        except BaseException:
            os.close(fd)
            raise
        return Folder(fd, where)

    def write(self, name: str, data: bytes, mode: int = 0o600) -> None:
        """``name`` with ``data``: written to an unguessable temporary name made here
        (``O_EXCL``, no link followed), then renamed over ``name`` inside this folder."""
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode, dir_fd=self.fd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def script(self, name: str) -> os.stat_result:
        """``name`` checked for running: a regular file of the user's that nobody else may
        write (opened without following a link)."""
        where = os.path.join(self.path, name)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if (st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode)
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            raise _unsafe(where, st, "is not a file of yours that only you may write, so it is "
                          "not run", "remove the run directory and submit again")
        return st


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


def _step(fd: int, name: str, where: str, create: bool, mode: int) -> tuple[int, str]:
    """One folder further (made with ``mode`` when missing and ``create``): its descriptor, or
    a symbolic link's target (fd -1) after checking who owns the link."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        if not create:
            raise
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, mode, dir_fd=fd)
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (0, os.geteuid()):
            raise _unsafe(where, st, f"is a symbolic link of {_name(st.st_uid)}, who may point "
                          "it elsewhere", "keep runs out of other users' links, " + ELSEWHERE)
        return -1, os.readlink(name, dir_fd=fd)
    return os.open(name, _DIR, dir_fd=fd), ""


def open_folder(path: str | os.PathLike[str], create: bool = False,
                mode: int = 0o755) -> Folder:
    """``path`` held open, every folder on the way from ``/`` checked (:func:`check_folder`);
    missing ones made (``mode``) when ``create``. Raises :class:`UnsafePlace`, or OSError."""
    me = os.geteuid()
    todo = _parts(os.path.abspath(os.fspath(path)))
    fd, where, links = os.open("/", _DIR), "/", 0
    try:
        check_folder(os.fstat(fd), where, me)
        while todo:
            name = todo.pop(0)
            following = os.path.join(where, name) if name != ".." else os.path.dirname(where)
            new, target = _step(fd, name, following, create, mode)
            if new < 0:
                links += 1
                if links > MAX_LINKS:
                    raise OSError(40, "too many levels of symbolic links", following)
                todo[:0] = _parts(target)
                if target.startswith("/"):
                    os.close(fd)
                    fd, where = os.open("/", _DIR), "/"
                continue
            os.close(fd)
            fd, where = new, following
            check_folder(os.fstat(fd), where, me)
    except BaseException:
        os.close(fd)
        raise
    return Folder(fd, where)


def run_folder(path: str | os.PathLike[str], create: bool = True) -> Folder:
    """The run directory ``path`` held open: the folders above it checked (made 0755 when
    missing), it made 0700 when missing (``create``), else it must be the user's own 0700
    folder."""
    full = os.path.abspath(os.fspath(path))
    parent = open_folder(os.path.dirname(full) or "/", create=create)
    with parent:
        return parent.folder(os.path.basename(full), create=create, what="a run directory")


def write_tree(path: str | os.PathLike[str], files: Mapping[str, str | bytes],
               executable: tuple[str, ...] = (".sh", ".sbatch")) -> None:
    """The run directory ``path`` (:func:`run_folder`) with ``files`` by relative name (``a/b``
    makes the private folder ``a``): 0700 for names ending in ``executable``, else 0600."""
    with run_folder(path) as top:
        held: dict[str, Folder] = {"": top}
        try:
            for name, text in files.items():
                folder, _, base = name.rpartition("/")
                if not base or ".." in name.split("/") or name.startswith("/"):
                    raise ValueError(f"not a name inside the run directory: {name!r}")
                place = _held(held, folder)
                data = text.encode("utf-8") if isinstance(text, str) else text
                place.write(base, data, 0o700 if base.endswith(executable) else 0o600)
        finally:
            for name, folder_ in held.items():
                if name:
                    folder_.close()


def _held(held: dict[str, Folder], name: str) -> Folder:
    """The folder ``name`` of the run directory (``held[""]``), made and opened once."""
    found = held.get(name)
    if found is None:
        parent, _, base = name.rpartition("/")
        found = held[name] = _held(held, parent).folder(base)
    return found


def runnable(run_dir: str | os.PathLike[str], script: str,
             folders: tuple[str, ...] = ()) -> str:
    """Right before a script of the run directory runs: the whole path walked again, the run
    directory (and each of ``folders`` in it, e.g. the sidecar's) the user's own 0700 folder,
    the script a file of the user's nobody else may write. Returns the script's path."""
    with run_folder(run_dir, create=False) as top:
        for name in folders:
            if _exists(top, name):
                top.folder(name, create=False).close()
        top.script(script)
        return os.path.join(top.path, script)


def check_main(argv: list[str]) -> int:
    """``RUN_DIR NAME...``, the shipped check run right before programs of the run directory
    are run by their paths on another machine (SSH's ``evidence.py``; Slurm's ``monitor.py``
    and batch script, and the sidecar folder, a ``NAME/``): 0 when :func:`runnable` holds for
    each, else 2 with the folder, its owner and mode, and the fix on stderr."""
    run_dir, *names = argv
    folders = tuple(name.rstrip("/") for name in names if name.endswith("/"))
    try:
        for name in (n for n in names if not n.endswith("/")):
            runnable(run_dir, name, folders)
    except (UnsafePlace, OSError) as exc:
        fix = f"; fix: {exc.unsafe.fix}" if isinstance(exc, UnsafePlace) else ""
        print(f"orchestrate: refused to run {os.path.join(run_dir, name)}: unsafe place: "
              f"{exc}{fix}", file=sys.stderr)
        return 2
    return 0


def _exists(folder: Folder, name: str) -> bool:
    try:
        os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def refusal(exc: UnsafePlace) -> dict[str, Any]:
    """An agent's reply for an unsafe place (the controller makes it a user error)."""
    return {"ok": False, "detail": f"unsafe place: {exc}; fix: {exc.unsafe.fix}",
            "unsafe": exc.unsafe.to_json()}


def optional_unsafe(reply: Mapping[str, Any]) -> Unsafe | None:
    """The :class:`Unsafe` in an agent's reply, if it carries one."""
    found = reply.get("unsafe")
    return Unsafe.from_json(found) if isinstance(found, dict) else None
