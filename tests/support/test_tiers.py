"""The tier marks and the unit guard (tests/support/tiers.py), on small suites run inline."""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.process  # the inner suites' refusals must not count against this test

# The hooks of tests/conftest.py that wire in the tiers, from tests.support.tiers itself (a
# conftest is pytest's, never imported: tests/support/test_layout.py).
CONFTEST = """
import pytest

from tests.support import tiers


def pytest_configure(config):
    tiers.install()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    tiers.resolve(items)
    tiers.group(items)


pytest_runtest_setup = tiers.guarded_setup
pytest_runtest_call = tiers.guarded_call
pytest_runtest_teardown = tiers.guarded_teardown
"""

INI = """
[pytest]
markers =
    unit: u
    process: p
    ssh: s
    slurm: s
    gpu: g
    torch: t
    slurm_release: r
"""


def _suite(pytester: pytest.Pytester, body: str) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    pytester.makepyfile(test_suite=textwrap.dedent(body))


def test_a_unit_test_that_starts_a_process_fails_even_when_it_catches_the_refusal(
        pytester: pytest.Pytester) -> None:
    _suite(pytester, """
        import contextlib, multiprocessing, os, socket, subprocess
        import pytest

        pytestmark = pytest.mark.unit

        def test_subprocess():
            subprocess.run(["true"])

        def test_caught():
            with contextlib.suppress(Exception):
                subprocess.run(["true"])

        def test_socket():
            socket.socket().close()

        def test_system():
            os.system("true")

        def test_multiprocessing():
            ctx = multiprocessing.get_context("spawn")
            process = ctx.Process(target=print)
            process.start()
            process.join()

        def test_pure(tmp_path):
            (tmp_path / "f").write_text("files are fine")
        """)
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=5)
    result.stdout.fnmatch_lines(["*unit test started a process or opened a socket*"])


def test_the_same_tests_run_in_the_process_tier(pytester: pytest.Pytester) -> None:
    _suite(pytester, """
        import socket, subprocess
        import pytest

        pytestmark = pytest.mark.process

        def test_subprocess():
            assert subprocess.run(["true"]).returncode == 0

        def test_socket():
            socket.socket().close()
        """)
    pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_an_unmarked_test_stops_the_collection_by_name(pytester: pytest.Pytester) -> None:
    _suite(pytester, """
        import pytest

        def test_forgotten():
            pass

        @pytest.mark.unit
        @pytest.mark.process
        def test_twice():
            pass
        """)
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_suite.py::test_forgotten: no tier mark*",
                                 "*test_suite.py::test_twice: two tier marks at one level*"])


def test_the_closest_tier_wins_and_m_sees_only_it(pytester: pytest.Pytester) -> None:
    _suite(pytester, """
        import pytest

        pytestmark = [pytest.mark.unit, pytest.mark.torch]

        def test_pure():
            pass

        @pytest.mark.process
        def test_starts_ranks():
            pass

        class TestGroup:
            pytestmark = pytest.mark.slurm

            def test_on_the_cluster(self):
                pass
        """)
    unit = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-m", "unit")
    unit.assert_outcomes(passed=1, deselected=2)
    process = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-m", "process")
    process.assert_outcomes(passed=1, deselected=2)
    slurm = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-m", "slurm and torch")
    slurm.assert_outcomes(passed=1, deselected=2)


def test_a_session_fixture_stopped_after_a_unit_test_is_not_that_tests(
        pytester: pytest.Pytester) -> None:
    """pytest tears a session fixture down in the last test's teardown: a unit test that
    happens to be last is not blamed for stopping what a process test started."""
    _suite(pytester, """
        import subprocess
        import pytest

        @pytest.fixture(scope="session")
        def server():
            yield
            subprocess.run(["true"], check=True)

        @pytest.mark.process
        def test_uses_the_server(server):
            pass

        @pytest.mark.unit
        def test_pure_and_last():
            pass
        """)
    pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_xdist_workers_take_the_costliest_groups_first(pytester: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pytest-xdist worker (``config.workerinput``, faked here for the collection only),
    the groups are sorted by their cost, each group's tests in their order: the file of ranks
    that train, the cluster's group, the file with a process test, then the unit files.
    Elsewhere nothing moves."""
    pytester.makeconftest(CONFTEST.replace("pytest_collection_modifyitems(items):", """\
pytest_collection_modifyitems(config, items):
    import os
    if os.environ.get("FAKE_XDIST_WORKER"):
        config.workerinput = {}""").replace("    tiers.group(items)\n", """\
    tiers.group(items)
    tiers.order(config, items)
    if hasattr(config, "workerinput"):
        del config.workerinput
"""))
    pytester.makeini(INI)
    pytester.makepyfile(
        test_a="import pytest\npytestmark = pytest.mark.unit\n"
               "def test_a1(): pass\ndef test_a2(): pass\n",
        test_b="import pytest\n@pytest.mark.unit\ndef test_b1(): pass\n"
               "@pytest.mark.process\ndef test_b2(): pass\n",
        test_c="import pytest\n@pytest.mark.unit\ndef test_c1(): pass\n"
               "@pytest.mark.ssh\ndef test_c2(): pass\n",
        test_d="import pytest\npytestmark = [pytest.mark.process, pytest.mark.torch]\n"
               "def test_d1(): pass\n")

    def collected() -> list[str]:
        result = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider")
        return [line.rsplit("::", 1)[1] for line in result.outlines if "::" in line]

    assert collected() == ["test_a1", "test_a2", "test_b1", "test_b2", "test_c1", "test_c2",
                           "test_d1"]
    monkeypatch.setenv("FAKE_XDIST_WORKER", "1")
    # A process test whose ranks train (torch) outweighs an ssh test without torch.
    assert collected() == ["test_d1", "test_c2", "test_b1", "test_b2", "test_a1", "test_a2",
                           "test_c1"]


def test_the_second_slurm_releases_tests_are_a_group_of_their_own(
        pytester: pytest.Pytester) -> None:
    """pytest -n 2: every 22.05 test with the one cluster's group, every 24.11 case (its
    ``slurm_release`` mark) in another, so one worker runs all of each cluster's tests."""
    _suite(pytester, """
        import pytest

        pytestmark = pytest.mark.slurm

        SECOND = pytest.param("24.11", marks=pytest.mark.slurm_release)

        @pytest.mark.parametrize("release", ["22.05", SECOND])
        def test_both(release):
            pass

        def test_first_only():
            pass

        @pytest.mark.process
        @pytest.mark.slurm_release
        def test_smoke():
            pass
        """)
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    groups = {item.name: item.get_closest_marker("xdist_group").args[0] for item in items}
    assert groups == {"test_both[22.05]": "slurm", "test_first_only": "slurm",
                      "test_both[24.11]": "slurm_release", "test_smoke": "slurm_release"}
