"""An optional extra that is not installed is named with its pip command, once, exit 2, no
traceback: the SSH probe without Fabric (it used to fail per host with
``ModuleNotFoundError: paramiko``). The missing modules are made missing the way Python itself
reports them: ``None`` in ``sys.modules`` (set by a ``sitecustomize`` on the CLI's path)."""

from __future__ import annotations

import pytest

from orchestrate.core.errors import UserError
from orchestrate.run.extras import EXTRAS, install_hint, missing, require
from tests.support.localcli import Cli

BLOCK = "import sys\nfor name in ('fabric', 'paramiko', 'invoke'):\n    sys.modules[name] = None\n"


@pytest.mark.unit
def test_an_optional_module_maps_to_its_extra_and_no_other_does() -> None:
    error = missing(ModuleNotFoundError("No module named 'paramiko'", name="paramiko"),
                    "inventory probe")
    assert error is not None and error.exit_status == 2
    text = error.problems[0].render()
    assert "inventory probe needs paramiko" in text
    assert "hint: install it with: pip install 'orchestrate[ssh]'" in text
    assert missing(ModuleNotFoundError("x", name="submitit.core")) is not None
    assert missing(ModuleNotFoundError("x", name="numpy")) is None
    assert missing(ImportError("x")) is None
    assert {EXTRAS["fabric"], EXTRAS["submitit"], EXTRAS["torch"]} == {"ssh", "slurm", "train"}
    assert "pip install -e '.[slurm]'" in install_hint("slurm")


@pytest.mark.unit
def test_require_passes_where_the_extra_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    require("ssh", "backend: ssh")  # the test environment has every extra
    monkeypatch.setitem(__import__("sys").modules, "invoke", None)
    with pytest.raises(UserError, match=r"backend: ssh needs invoke"):
        require("ssh", "backend: ssh")


@pytest.mark.process
def test_probing_over_ssh_without_fabric_names_the_pip_command(cli: Cli) -> None:
    blocker = cli.work / "no-ssh-extra"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCK)
    cli.env["PYTHONPATH"] = f"{blocker}:{cli.env.get('PYTHONPATH', '')}"
    done = cli.run("inventory", "probe", "198.18.0.7", "198.18.0.8", "-o", "inv.yaml")
    assert done.returncode == 2, done.stderr
    assert "pip install 'orchestrate[ssh]'" in done.stderr
    assert done.stderr.count("error:") == 1, done.stderr  # once, not once per host
    assert "Traceback" not in done.stderr and "ModuleNotFoundError" not in done.stderr
    assert not (cli.work / "inv.yaml").exists()
