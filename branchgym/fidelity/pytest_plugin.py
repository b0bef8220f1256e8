"""pytest plugin (entry point ``pytest11: branchgym``): snapshot fidelity in your own suite.

Installed with branchgym, so any project's pytest gains, with one line:

* the ini option ``branchgym_fidelity``: one test per listed env, e.g. in
  ``pyproject.toml``::

      [tool.pytest.ini_options]
      branchgym_fidelity = ["my_pkg.envs:Sandbox", "mylab/Sandbox-v0"]

  (``--branchgym-fidelity TARGET`` on the command line does the same);
* the fixture ``snapshot_fidelity``: ``snapshot_fidelity(MySandbox)`` runs
  :func:`branchgym.fidelity.suite.check_snapshot_fidelity` and fails the test with its report.

``branchgym.fidelity.suite.fidelity_test(MySandbox)`` is the plugin-free alternative. Disable
the plugin with ``-p no:branchgym``. Importing this module is cheap: branchgym itself
is imported only when a check runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

INI = "branchgym_fidelity"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ini option and the command-line option."""
    parser.addini(
        INI,
        type="linelist",
        default=[],
        help="env targets (registered id or module:attr) whose snapshot fidelity is tested",
    )
    group = parser.getgroup("branchgym")
    group.addoption(
        "--branchgym-fidelity",
        action="append",
        default=[],
        metavar="TARGET",
        help="add a snapshot-fidelity test for TARGET (registered id or module:attr)",
    )
    group.addoption(
        "--branchgym-max-examples",
        type=int,
        default=None,
        help="programs per fidelity test (default: the property suite's default budget)",
    )


def _check(target: Any, default_max_examples: int | None, kwargs: dict[str, Any]) -> Any:
    from branchgym.fidelity.suite import DEFAULT_MAX_EXAMPLES, check_snapshot_fidelity

    kwargs = {"max_examples": default_max_examples or DEFAULT_MAX_EXAMPLES, **kwargs}
    return check_snapshot_fidelity(target, **kwargs)


class FidelityItem(pytest.Item):
    """One snapshot-fidelity test for a target named in the configuration."""

    def __init__(self, *, target: str, **kwargs: Any) -> None:
        """Test ``target``."""
        super().__init__(**kwargs)
        self.target = target

    def runtest(self) -> None:
        """Run the property suite; a failed report is the test failure."""
        report = _check(self.target, self.config.getoption("--branchgym-max-examples"), {})
        if not report.ok:
            raise FidelityFailed(str(report))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        """The report itself (with its pasteable program), not a traceback."""
        if isinstance(excinfo.value, FidelityFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        """Where the test comes from, for pytest's output."""
        return "branchgym-fidelity", None, f"snapshot fidelity of {self.target}"


class FidelityFailed(AssertionError):
    """The property suite found a violation (the message is the report)."""


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection, so they apply to these tests too
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Append one :class:`FidelityItem` per configured target."""
    targets = list(config.getini(INI)) + list(config.getoption("--branchgym-fidelity") or [])
    for target in dict.fromkeys(t.strip() for t in targets if t.strip()):
        items.append(
            FidelityItem.from_parent(session, name=f"branchgym-fidelity[{target}]", target=target)
        )


@pytest.fixture
def snapshot_fidelity(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``snapshot_fidelity(env_fn, **kwargs)``: check an env, fail the test on a violation.

    Keyword arguments go to :func:`branchgym.fidelity.suite.check_snapshot_fidelity`; the
    report is returned when the env passes.
    """
    max_examples = request.config.getoption("--branchgym-max-examples")

    def check(env_fn: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        report = _check(env_fn, max_examples, kwargs)
        if not report.ok:
            pytest.fail(str(report), pytrace=False)
        return report

    yield check
