"""The whole suite's hooks: every test carries one tier mark, and ``unit`` tests are guarded
(tests/support/tiers.py says why and how). And the fixtures that tests in more than one folder
use, found here by pytest itself; the helpers they hand out live in tests/support/."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from orchestrate.hostside import host
from tests.support import busy, tiers
from tests.support.localcli import Cli
from tests.support.slurmcli import OrchestrateCli
from tests.support.slurmcluster import HOST_RELEASE, SlurmCluster, cluster_up
from tests.support.sshcli import SshCli
from tests.support.sshhosts import SshHosts, end_strays, hosts_up, stop_tagged

pytest_plugins = ["pytester"]  # tests/support/test_tiers.py runs small suites inline


def pytest_addoption(parser: pytest.Parser) -> None:
    busy.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    tiers.install()
    # A run started as a background job of a script (``cmd &``) inherits SIGINT ignored, and so
    # would every process the tests start: the tests that press Ctrl-C on the CLI need it
    # delivered as a terminal delivers it. A caught signal is reset to the default in children.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    busy.start(config)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: it must see the resolved tiers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers.resolve(items)
    tiers.group(items)
    tiers.order(config, items)


pytest_runtest_setup = tiers.guarded_setup
pytest_runtest_call = tiers.guarded_call
pytest_runtest_teardown = tiers.guarded_teardown


@pytest.fixture(autouse=True)
def private_lease_book(tmp_path_factory: pytest.TempPathFactory,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets a lease book of its own (``ORCHESTRATE_LEASES``, inherited by every
    orchestrate it starts): the machine's shared book (/var/tmp/orchestrate/leases) would let a
    job of one test session -- another engineer's, on a shared box -- refuse another's. Tests of
    the shared book itself set their own."""
    monkeypatch.setenv("ORCHESTRATE_LEASES", str(tmp_path_factory.mktemp("leases")))


@pytest.fixture()
def chdir_tmp(tmp_path: Path) -> Iterator[Path]:
    """Run the test inside ``tmp_path``."""
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)


def _private_env(base: Mapping[str, str], home: Path, work: Path,
                 *unset: str) -> dict[str, str]:
    """``base`` with a job store of the test's own (ORCHESTRATE_HOME, ORCHESTRATE_RUNS), and
    without the variables an orchestrate job sets (this suite may itself run inside a job)."""
    env = dict(base, ORCHESTRATE_HOME=str(home), ORCHESTRATE_RUNS=str(work / "runs"))
    for name in ("ORCHESTRATE_JOB_ID", *unset):
        env.pop(name, None)
    return env


def _work(tmp_path: Path) -> tuple[Path, Path]:
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    return home, work


def _runs(work: Path) -> list[str]:
    runs = work / "runs"
    return [run.name for run in runs.glob("*")] if runs.exists() else []


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    """The CLI of the local backend, with a job store of its own; whatever it started is reaped
    when the test ends."""
    home, work = _work(tmp_path)
    yield Cli(home=home, work=work, env=_private_env(os.environ, home, work),
              uid=uuid.uuid4().hex[:6])
    # Whatever a test leaves behind is a failure of that test, but never of the next one.
    for run in _runs(work):
        host.reap(run, 1.0)


@pytest.fixture(scope="session")
def ssh_hosts() -> Iterator[SshHosts]:
    """Three real SSH hosts h1..h3 for the whole session; torn down and checked clean at the end
    (one bring-up for the SSH tests, the backend contract test and the frameworks' tests)."""
    yield from hosts_up()


@pytest.fixture
def no_stray_remote_processes(ssh_hosts: SshHosts) -> Iterator[None]:
    """After the test, nothing but the sshd listeners may run on the hosts (autouse in
    tests/backends/ssh/; the other SSH tests ask for it by name)."""
    yield
    end_strays(ssh_hosts)


@pytest.fixture
def ssh_cli(ssh_hosts: SshHosts, tmp_path: Path) -> Iterator[SshCli]:
    """A CLI for SSH jobs on the test hosts; every job it ran is stopped on every host after."""
    home, work = _work(tmp_path)
    yield SshCli(hosts=ssh_hosts, home=home, work=work, env=_private_env(os.environ, home, work))
    for run in _runs(work):
        stop_tagged(ssh_hosts, run, grace_s=1.0)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """The real Slurm test cluster for the whole session (tests/support/slurmcluster.py)."""
    yield from cluster_up()


@pytest.fixture(scope="session")
def slurm_cluster_2411() -> Iterator[SlurmCluster]:
    """The second real Slurm cluster, Debian 13's 24.11 from its own root, for the whole session
    (tests/support/slurmcluster.py); its tests skip, with the reason, without the root."""
    yield from cluster_up(second=True)


@pytest.fixture
def slurm_release(request: pytest.FixtureRequest) -> str:
    """The Slurm release ``ocli`` talks to: 22.05 unless the test is ``@BOTH_RELEASES``."""
    return str(getattr(request, "param", HOST_RELEASE))


@pytest.fixture
def ocli(slurm_release: str, request: pytest.FixtureRequest,
         tmp_path: Path) -> Iterator[OrchestrateCli]:
    """The CLI pointed at the Slurm test cluster (of ``slurm_release``), with a job store of its
    own; its jobs that still run when the test ends are cancelled."""
    slurm_cluster: SlurmCluster = request.getfixturevalue(
        "slurm_cluster" if slurm_release == HOST_RELEASE else "slurm_cluster_2411")
    home, work = _work(tmp_path)
    env = _private_env(slurm_cluster.env, home, work, "RANK", "WORLD_SIZE", "LOCAL_RANK")
    slurm_cluster.heal()
    yield OrchestrateCli(slurm_cluster, home, work, env)
    # A test that failed half way must not leave its jobs to the next one.
    for line in slurm_cluster.run("squeue", "-h", "-o", "%i %o", check=False).stdout.splitlines():
        job_id, _, command = line.partition(" ")
        if command.startswith(str(work)):
            slurm_cluster.run("scancel", job_id, check=False)
