"""Test outcomes the code under test cannot forge by printing: pytest's own reports, recorded.

Upstream SWE-bench grades the test log, and the code under test runs in the test
runner's process: it can print any line the log parser reads and leave with
``os._exit(0)``. With the harness guard on, :func:`install` puts a small pytest plugin
in the grading sandbox (a module with a random name in ``.git/``, which no test sees)
and names it with ``-p`` in ``PYTEST_ADDOPTS``; pytest imports it before any conftest,
test module or code under test. It writes every test's reports, as pytest made them, to
a file of the same random name, one JSON line at a time, and removes itself from the
environment so nothing the tests start sees it. :func:`check` then accepts a graded
log only when that record is complete and agrees with it:

* the session started and finished, and every collected test has its last (teardown)
  report: a run that ends early (``os._exit``, a crash, a kill) is not resolved;
* every FAIL_TO_PASS and PASS_TO_PASS test has the status in the log that pytest's
  reports give it: a log that says otherwise (printed lines) is not resolved;
* pytest's reporting machinery is as it was when the plugin loaded (the functions that
  run tests and build their reports, pluggy's hook calling), and no plugin registered
  after the session started (other than a conftest) implements the hooks that decide
  outcomes: monkeypatching pytest, or registering a plugin from the code under test,
  is not resolved.

What stays possible: code in the runner's process can in principle tamper with
anything in it, this plugin and its file included (find it, write lines to it, patch
its functions before they run). The checks make the cheap forgeries fail and the rest
deliberate; a policy that learns them is visible in its diff. Runners other than
pytest (Django's ``runtests.py``, Sympy's ``bin/test``) have no such record: their
tasks are graded from the log alone, and the report says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from branchgym.envs.swebench.tasks import SWEBenchTask

if TYPE_CHECKING:
    from branchgym.envs.swebench.sandbox import Sandbox

__all__ = ["PYTEST_PARSERS", "PLUGIN_SOURCE", "Recorder", "uses_pytest", "install", "check"]

#: The package's log parsers that read pytest's output.
PYTEST_PARSERS = frozenset({"parse_log_pytest", "parse_log_pytest_options", "parse_log_pytest_v2"})

#: The plugin, formatted with the report's path. Kept to the standard library and the
#: hooks pytest 6 to 9 share.
PLUGIN_SOURCE = r'''
"""branchgym's outcome recorder (see branchgym.envs.swebench.outcomes)."""
import hashlib as _hashlib
import hmac as _hmac
import json as _json
import os as _os
import sys as _sys

import pytest as _pytest_mod

_PATH = {path!r}
_NAME = {name!r}
_KEY = bytes.fromhex({key!r})
_FD = _os.open(_PATH, _os.O_WRONLY | _os.O_APPEND)
_MAC = [b""]


def _emit(**event):
    # Each line is chained to the last with a key only this process holds: a line
    # written by anything else breaks the chain.
    body = _json.dumps(event, sort_keys=True)
    _MAC[0] = _hmac.new(_KEY, _MAC[0] + body.encode(), _hashlib.sha256).hexdigest().encode()
    _os.write(_FD, (_json.dumps({{"e": event, "mac": _MAC[0].decode()}}) + "\n").encode())


# The key leaves the disk: the source (and any bytecode of it) is removed once imported.
for _p in (__file__, getattr(__spec__, "cached", None) or ""):
    try:
        _os.unlink(_p)
    except OSError:
        pass


# Out of the environment: nothing the tests start loads this plugin again.
_addopts = _os.environ.get("PYTEST_ADDOPTS", "").replace("-p " + _NAME, "").strip()
if _addopts:
    _os.environ["PYTEST_ADDOPTS"] = _addopts
else:
    _os.environ.pop("PYTEST_ADDOPTS", None)
_here = _os.path.dirname(_os.path.abspath(__file__))
_pp = [p for p in _os.environ.get("PYTHONPATH", "").split(_os.pathsep) if p and p != _here]
if _pp:
    _os.environ["PYTHONPATH"] = _os.pathsep.join(_pp)
else:
    _os.environ.pop("PYTHONPATH", None)


def _watched():
    """The functions that run tests and build and deliver their reports."""
    import importlib

    names = {{
        "_pytest.runner": ["call_and_report", "runtestprotocol", "call_runtest_hook",
                           "pytest_runtest_protocol", "pytest_runtest_makereport",
                           "pytest_runtest_call", "CallInfo.from_call",
                           "check_interactive_exception"],
        "_pytest.reports": ["TestReport.from_item_and_call", "TestReport.__init__",
                            "BaseReport.passed", "BaseReport.failed", "BaseReport.skipped"],
        "_pytest.python": ["Function.runtest", "pytest_pyfunc_call"],
        "_pytest.unittest": ["TestCaseFunction.runtest", "pytest_runtest_makereport"],
        "_pytest.skipping": ["pytest_runtest_makereport", "pytest_runtest_call"],
        "_pytest.main": ["pytest_runtestloop", "Session.perform_collect"],
        "_pytest.terminal": ["TerminalReporter.pytest_runtest_logreport",
                             "TerminalReporter.short_test_summary"],
        "pluggy._callers": ["_multicall"],
        "pluggy._hooks": ["HookCaller.__call__", "_HookCaller.__call__"],
        "pluggy._manager": ["PluginManager._hookexec"],
        "unittest.case": ["TestCase.run", "TestCase.__call__"],
    }}
    out = {{}}
    for mod, attrs in names.items():
        try:
            m = importlib.import_module(mod)
        except Exception:
            continue
        for attr in attrs:
            obj, ok = m, True
            for part in attr.split("."):
                d = getattr(obj, "__dict__", {{}})
                if part in d:
                    obj = d[part]
                else:
                    ok = False
                    break
            if ok:
                out[(mod, attr)] = obj
    return out


_WATCHED = _watched()
_SENSITIVE = ("pytest_runtest_makereport", "pytest_runtest_protocol", "pytest_runtest_call",
              "pytest_pyfunc_call", "pytest_report_teststatus", "pytest_runtest_logreport",
              "pytest_runtestloop", "pytest_runtest_setup", "pytest_runtest_teardown",
              "pytest_terminal_summary")
_OWNER = []
_emit(event="load", pid=_os.getpid())


class _Recorder:
    def __init__(self, config):
        self.config = config
        self.known = set()
        self.flagged = set()

    def _tampered(self):
        for (mod, attr), obj in _WATCHED.items():
            key = mod + "." + attr
            if key in self.flagged:
                continue
            cur = _sys.modules.get(mod)
            for part in attr.split("."):
                cur = getattr(cur, "__dict__", {{}}).get(part)
            if cur is not obj:
                self.flagged.add(key)
                _emit(event="tamper", what=key + " was replaced")
        pm = self.config.pluginmanager
        for hook in _SENSITIVE:
            caller = getattr(pm.hook, hook, None)
            if caller is None:
                continue
            for impl in caller.get_hookimpls():
                plugin = impl.plugin
                if id(plugin) in self.known or id(plugin) in self.flagged:
                    continue
                if _os.path.basename(getattr(plugin, "__file__", "") or "") == "conftest.py":
                    continue
                self.flagged.add(id(plugin))
                _emit(event="tamper", what=f"plugin {{impl.plugin_name!r}} implementing {{hook}} "
                      "was registered during the session")

    @_pytest_mod.hookimpl(trylast=True)
    def pytest_sessionstart(self, session):
        self.known = {{id(p) for p in self.config.pluginmanager.get_plugins()}}
        _emit(event="start")

    def pytest_collection_finish(self, session):
        _emit(event="collected", ids=[item.nodeid for item in session.items])
        self._tampered()

    def pytest_runtest_logreport(self, report):
        _emit(event="report", id=report.nodeid, when=report.when, outcome=report.outcome,
              xfail=hasattr(report, "wasxfail"))

    def pytest_sessionfinish(self, session, exitstatus):
        self._tampered()
        _emit(event="finish", exitstatus=int(exitstatus))


def pytest_configure(config):
    if _OWNER:  # a nested in-process session (pytester): not the graded one
        return
    _OWNER.append(config)
    config.pluginmanager.register(_Recorder(config), "branchgym-outcome-recorder")
'''


def uses_pytest(task: SWEBenchTask) -> bool:
    """Whether ``task``'s tests run under pytest (its log parser reads pytest's output)."""
    from branchgym.envs.swebench import harness

    return harness.log_parser_name(task) in PYTEST_PARSERS


@dataclasses.dataclass(frozen=True)
class Recorder:
    """Where one grading run's plugin and record live in the sandbox.

    Attributes:
        name: The plugin's module name (random).
        folder: Its folder, relative to the work tree.
        report: The record's path, relative to the work tree.
        key: The key that chains the record's lines (hex), known to the plugin only.
    """

    name: str
    folder: str
    report: str
    key: str = dataclasses.field(default="", repr=False)

    def environment(self, base: Mapping[str, str], workdir: str) -> dict[str, str]:
        """``base`` with the plugin named in ``PYTEST_ADDOPTS`` and its folder on ``PYTHONPATH``."""
        env = dict(base)
        env["PYTEST_ADDOPTS"] = " ".join(
            filter(None, [env.get("PYTEST_ADDOPTS", ""), f"-p {self.name}"])
        )
        env["PYTHONPATH"] = ":".join(
            filter(None, [f"{workdir}/{self.folder}", env.get("PYTHONPATH", "")])
        )
        return env


def install(sandbox: Sandbox) -> Recorder:
    """Write the plugin and an empty record into ``sandbox`` (under ``.git/``, unseen by tests)."""
    token = secrets.token_hex(8)
    key = secrets.token_hex(32)
    name = f"_branchgym_outcomes_{token}"
    folder = f".git/branchgym-{token}"
    report = f"{folder}/{token}.jsonl"
    path = f"{sandbox.workdir}/{report}"
    sandbox.write(report, b"", mode=0o666)
    source = PLUGIN_SOURCE.format(path=path, name=name, key=key)
    sandbox.write(f"{folder}/{name}.py", source.encode(), mode=0o644)
    # The tests may run as another user than the one who wrote the files, and the
    # plugin removes its source (which holds the key) once imported.
    sandbox.exec(f"chmod 777 {folder} 2>/dev/null; true", cwd=sandbox.workdir, timeout=30)
    return Recorder(name, folder, report, key)


def _statuses(events: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Each test's status as ``-rA`` prints it, from pytest's reports (later lines win)."""
    phases: dict[str, dict[str, Mapping[str, Any]]] = {}
    for e in events:
        if e.get("event") == "report":
            phases.setdefault(str(e["id"]), {})[str(e["when"])] = e
    out = {}
    for test, ph in phases.items():
        setup, call, teardown = ph.get("setup"), ph.get("call"), ph.get("teardown")
        status = None
        if setup is not None and setup["outcome"] == "failed":
            status = "ERROR"
        elif setup is not None and setup["outcome"] == "skipped":
            status = "XFAIL" if setup.get("xfail") else "SKIPPED"
        elif call is not None:
            if call["outcome"] == "passed":
                status = "XPASS" if call.get("xfail") else "PASSED"
            elif call["outcome"] == "skipped":
                status = "XFAIL" if call.get("xfail") else "SKIPPED"
            else:
                status = "FAILED"
        if teardown is not None and teardown["outcome"] == "failed" and status != "FAILED":
            status = "ERROR"
        if status is not None:
            out[test] = status
    return out


def check(
    record: str,
    task: SWEBenchTask,
    status_map: Mapping[str, str],
    parse: Any = None,
    key: str = "",
) -> str:
    """Why the log's verdict cannot be trusted ("" when the record confirms it).

    Args:
        record: The plugin's record (JSON lines).
        task: The task (its FAIL_TO_PASS and PASS_TO_PASS tests are compared).
        status_map: What the package's log parser read from the log.
        parse: The repository's log parser (``log -> status map``), to read the
            record's statuses under the same test names as the log's; default: names
            as pytest gives them.
        key: The recorder's key (:attr:`Recorder.key`): each line's chained MAC is checked.
    """
    events = []
    mac = b""
    for line in record.splitlines():
        try:
            obj = json.loads(line)
            event, given = obj["e"], str(obj["mac"])
            body = json.dumps(event, sort_keys=True).encode()
        except (json.JSONDecodeError, KeyError, TypeError):
            return "the outcome record has a line its plugin did not write (it was written to)"
        mac = hmac.new(bytes.fromhex(key), mac + body, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(mac, given.encode()):
            return "the outcome record has a line its plugin did not write (it was written to)"
        events.append(event)
    kinds = [e.get("event") for e in events]
    if "load" not in kinds:
        return (
            "the trusted outcome record is empty: branchgym's pytest plugin never loaded "
            "(the test run did not start pytest as the task's test command does)"
        )
    tamper = [str(e.get("what")) for e in events if e.get("event") == "tamper"]
    if tamper:
        return "the test run tampered with pytest's reporting: " + "; ".join(tamper[:3])
    if "start" not in kinds or "collected" not in kinds:
        return "the test run ended before pytest collected the tests (outcome record incomplete)"
    if "finish" not in kinds:
        return (
            "the test run ended before pytest finished the session (os._exit, a crash or "
            "a kill): the outcome record is incomplete"
        )
    collected = [str(i) for e in events if e.get("event") == "collected" for i in e["ids"]]
    done = {str(e["id"]) for e in events if e.get("event") == "report" and e["when"] == "teardown"}
    missing = [i for i in collected if i not in done]
    if missing:
        return (
            f"{len(missing)} collected test(s) have no outcome in pytest's reports "
            f"(e.g. {missing[0]}): the run ended early"
        )
    statuses = _statuses(events)
    if parse is not None:
        # As -rA prints them: a skip by its location (most parsers read no test id
        # there), an unexpected pass as XPASS (no parser's status).
        lines = "\n".join(
            f"SKIPPED [1] {t}: skipped" if s == "SKIPPED" else f"{s} {t}"
            for t, s in statuses.items()
        )
        statuses = dict(parse(lines))
    for test in (*task.fail_to_pass, *task.pass_to_pass):
        logged, real = status_map.get(test), statuses.get(test)
        if logged != real:
            return (
                f"the log says {test} {logged or 'did not run'}, pytest's own reports say "
                f"{real or 'it did not run'}: the log was written to"
            )
    return ""
