"""What orchestrate ships to other machines: every owner's manifest, linted and compiled for 3.8.

Each shipped program is declared by the module that ships it, as a module-level
``hostside.shipping.Manifest`` (the SSH agent's in ``backends/ssh/channels.py``, and so on). This
file finds every one by reading orchestrate's sources, so a program added anywhere is checked
here without being listed. A program runs on nodes with the standard library only and often an
old Python (a compute node's system python3, Python 3.8 on an older distribution), with ``-S``.
So each module it carries must be in pyproject's Python 3.8 target (ruff then flags newer
syntax), must import only the standard library and the modules carried with it, and each whole
program must compile under Python 3.8 where one is installed.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from functools import cache
from pathlib import Path, PurePosixPath

import pytest
import tomllib

from orchestrate.hostside import shipping
from orchestrate.hostside.shipping import Manifest, module_source, program
from tests.support.python38 import python38

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "orchestrate"

#: Programs that must be found (so a broken search cannot pass by finding nothing).
KNOWN = {"agent", "evidence", "monitor", "watchdog", "gatherer", "sidecar"}


def _declarations(path: Path) -> tuple[list[str], list[int]]:
    """The names ``path`` binds to a ``Manifest(...)`` at module level, and the lines of any
    other ``Manifest(...)`` call (which the search could not follow)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    declared: list[str] = []
    at_top: set[int] = set()
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and _is_manifest(node.value)):
            declared.append(node.targets[0].id)
            at_top.add(id(node.value))
    stray = [node.lineno for node in ast.walk(tree)
             if _is_manifest(node) and id(node) not in at_top]
    return declared, stray


def _is_manifest(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == "Manifest") or (
        isinstance(func, ast.Attribute) and func.attr == "Manifest")


@cache
def manifests() -> dict[str, Manifest]:
    """Every manifest declared in orchestrate, by program name."""
    found: dict[str, Manifest] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(shipping.__file__):
            continue
        declared, stray = _declarations(path)
        assert stray == [], f"{path}:{stray}: declare a Manifest at module level, by name"
        if not declared:
            continue
        owner = importlib.import_module(
            ".".join(path.relative_to(REPO).with_suffix("").parts))
        for name in declared:
            manifest = getattr(owner, name)
            assert isinstance(manifest, Manifest), f"{owner.__name__}.{name}"
            assert manifest.name not in found, f"two programs called {manifest.name!r}"
            found[manifest.name] = manifest
    return found


def _py38_patterns() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    targets = config["tool"]["ruff"]["per-file-target-version"]
    return [pattern for pattern, version in targets.items() if version == "py38"]


def _file_of(module: str) -> str:
    return module.replace(".", "/") + ".py"


@pytest.mark.unit
def test_every_program_is_declared_by_its_owner_and_found() -> None:
    assert set(manifests()) >= KNOWN


@pytest.mark.unit
def test_the_host_side_names_no_module_it_ships() -> None:
    """``hostside`` is the bottom layer: it reads the modules it is handed and never imports
    one by name (it did, and so loaded the backends: review E1)."""
    tree = ast.parse(Path(shipping.__file__).read_text(encoding="utf-8"))
    names = {node.id if isinstance(node, ast.Name) else node.attr for node in ast.walk(tree)
             if isinstance(node, ast.Name | ast.Attribute)}
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}
    assert names & {"import_module", "__import__"} == set()
    assert imported & {"importlib", "orchestrate"} == set()


@pytest.mark.unit
def test_every_shipped_module_is_linted_for_python_3_8() -> None:
    patterns = _py38_patterns()
    missing = sorted({module for manifest in manifests().values() for module in manifest.names
                      if not any(PurePosixPath(_file_of(module)).match(p) or
                                 _file_of(module).startswith(p.removesuffix("**"))
                                 for p in patterns)})
    assert missing == []


@pytest.mark.unit
def test_every_single_file_on_the_python_3_8_list_is_shipped() -> None:
    """The other way round: a file named alone on the list is carried by some program (or is
    the doctor's reachability module, which the checkup runs on the nodes), so the list does
    not keep a file that stopped being shipped."""
    carried = {_file_of(module) for manifest in manifests().values()
               for module in manifest.names}
    alone = {p for p in _py38_patterns() if not p.endswith("**")}
    assert sorted(alone - carried - {"orchestrate/doctor/checkup/reachability.py"}) == []


def _module_level_imports(source: str) -> list[str]:
    """The top-level packages a module imports when it loads (not inside its functions: a
    shipped module may import torch lazily, in the rank that has it)."""
    found: list[str] = []
    pending: list[ast.AST] = list(ast.parse(source).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found.extend(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module.split(".")[0])
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return found


def _orchestrate_imports(source: str) -> set[str]:
    """The orchestrate modules a module imports when it loads (module level, as above)."""
    found: set[str] = set()
    pending: list[ast.AST] = list(ast.parse(source).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("orchestrate."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.startswith("orchestrate."):
            found.add(node.module)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return found


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(manifests()))
def test_every_shipped_program_carries_what_its_modules_import(name: str) -> None:
    """A shipped program runs with ``-S`` where orchestrate is not installed: a module it
    carries that imports one it does not carry fails there at start (the watchdog did, when
    the lease book came to import gpuuse)."""
    manifest = manifests()[name]
    carried = set(manifest.names)
    for module in manifest.modules:
        wanted = _orchestrate_imports(module_source(module))
        assert wanted <= carried, f"{name}: {module.__name__} imports {sorted(wanted - carried)}"


@pytest.mark.unit
def test_every_shipped_module_uses_only_the_standard_library() -> None:
    allowed = set(sys.stdlib_module_names) | {"orchestrate", "__future__"}
    for manifest in manifests().values():
        for module in manifest.modules:
            imported = set(_module_level_imports(module_source(module)))
            assert imported <= allowed, f"{module.__name__} imports {sorted(imported - allowed)}"


@pytest.mark.process
@pytest.mark.parametrize("name", sorted(manifests()))
def test_every_shipped_program_compiles_on_python_3_8(name: str, tmp_path: Path) -> None:
    python = python38()
    if python is None:
        pytest.skip("no Python 3.8 interpreter on this machine")
    manifest = manifests()[name]
    text = program(manifest, "pass")
    path = tmp_path / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    sources = [module_source(m) for m in manifest.modules]
    check = ("import sys\n"
             "for path in sys.argv[1:]:\n"
             "    compile(open(path, encoding='utf-8').read(), path, 'exec')\n")
    modules = []
    for i, source in enumerate(sources):
        module_file = tmp_path / f"m{i}.py"
        module_file.write_text(source, encoding="utf-8")
        modules.append(str(module_file))
    done = subprocess.run([python, "-S", "-c", check, str(path), *modules],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.unit
def test_every_program_sent_on_a_command_line_fits_one_argument() -> None:
    """Linux takes one argument of at most 128 KiB, and sshd hands the whole remote command to
    the shell as one: the agent grew to 174 KB when three engineers each added a module, and
    every SSH job failed with "Argument list too long". The agent's command, the facts
    gatherer's and the local watchdog's (``python -S -c TEXT``) keep a quarter of the limit
    free for what comes next."""
    from orchestrate.backends.detached import WATCHDOG
    from orchestrate.backends.ssh.channels import agent_command
    from orchestrate.probe.gathering import facts_argv, shell_command

    limit = shipping.MAX_ARGUMENT * 3 // 4
    agent = agent_command("/usr/bin/python3", "serve")
    assert len(agent) < limit, f"the agent's remote command is {len(agent)} bytes"
    facts = shell_command(facts_argv("/usr/bin/python3", ["h1", "h2"], bound_s=10))
    assert len(facts) < limit, f"the facts program is {len(facts)} bytes"
    watchdog = shipping.compact(program(WATCHDOG, "from orchestrate.hostside.watchdog import "
                                        "watch\nwatch(1, None, 'job', 5.0)"))
    assert len(watchdog) < limit, f"the watchdog is {len(watchdog)} bytes: compact() it"


@pytest.mark.process
def test_a_compacted_program_runs_as_the_whole_text_does(tmp_path: Path) -> None:
    """The agent sent compacted (``-c``) answers as its whole text does (from a file: on a
    command line it no longer fits), its ``gpus`` command run under ``-S`` with no orchestrate
    on the path."""
    from orchestrate.backends.ssh.channels import agent_source

    whole = tmp_path / "agent.py"
    whole.write_text(agent_source(), encoding="utf-8")
    outputs = []
    for how in ([str(whole)], ["-c", shipping.compact(agent_source())]):
        done = subprocess.run([sys.executable, "-S", *how, "gpus", ""], cwd="/",
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stdout.split(" ", 1)[0].lstrip("\x1e"))  # after the mark byte
    assert outputs[0] == outputs[1] == "orchestrate:gpus"
