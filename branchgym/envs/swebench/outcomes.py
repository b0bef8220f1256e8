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
  run tests and build their reports, pluggy's hook calling), no plugin registered
  after the session started (other than a conftest) implements the hooks that decide
  outcomes, and none of pytest's own implementations was removed: monkeypatching
  pytest, or registering or unregistering a plugin from the code under test, is not
  resolved;
* the tests that run are the tests the task brought. Before the patch applies, the
  grader reads the git blob id of each Python file of the base commit with the test
  patch applied (:func:`trusted_sources`), less the files the patch changes. Every
  collected test's code (through bound methods, decorators and wrappers), and every
  function and class of its test module, must be what the plugin compiles itself from
  those bytes (plain, and rewritten by pytest's assertion rewriter as pytest does);
  unittest's ``TestCase`` and the rest of the framework (pytest's runner, reports,
  assertion rewriting, ``pytest.raises``/``approx``, pluggy, a few builtins) must be
  the objects, with the code, they were when the plugin loaded; no trace or profile
  function may appear (``sys.settrace``, ``setprofile``, ``threading``'s, ``sys.monitoring``);
  a collected item may not carry its own ``runtest``. This is checked when collection
  ends, before each test's call (its fixtures set up), and when the session ends; an audit hook
  also records, as it happens, every ``sys.settrace``/``setprofile`` call and every
  change to a test's or the framework's function code made while code the grader does
  not trust (a file the patch changed or added) is on the stack;
* no passing assertion compared an object that says it equals anything: for each
  passing plain ``assert`` (pytest's ``pytest_assertion_pass`` hook, turned on for the
  run) and each passing ``TestCase.assertEqual``, an operand whose type's ``__eq__`` is
  the repository's (not the test patch's) and says it equals a fresh object of a class
  nothing has seen is reported.

What stays possible: code in the runner's process can in principle tamper with
anything in it, this plugin and its file included (find it, change what it trusts or
compares, write lines to it, patch its functions before they run); a class attribute
swapped and restored within one test's call raises no audit event and is back before
the next check; code compiled under a library's file name passes for library code; an
object whose ``__eq__`` lies only to the values the tests expect, or a library type
that equals anything (``unittest.mock.ANY``), is not told from an honest one. The
checks make the cheap forgeries fail and the rest deliberate; a policy that learns them
is visible in its diff. Runners other than pytest (Django's ``runtests.py``, Sympy's
``bin/test``) have no such record: their tasks are graded from the log alone, and the
report says so.
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

__all__ = [
    "PYTEST_PARSERS",
    "PLUGIN_SOURCE",
    "PASS_HOOK_OPTION",
    "Recorder",
    "Trust",
    "blob_id",
    "trusted_sources",
    "uses_pytest",
    "install",
    "check",
]

#: The package's log parsers that read pytest's output.
PYTEST_PARSERS = frozenset({"parse_log_pytest", "parse_log_pytest_options", "parse_log_pytest_v2"})

#: The plugin; ``__PATH__``, ``__NAME__``, ``__KEY__`` and ``__TRUST__`` are replaced with
#: Python literals. Kept to the standard library and what pytest 6 to 9 share.
PLUGIN_SOURCE = r'''
"""branchgym's outcome recorder (see branchgym.envs.swebench.outcomes)."""
import ast as _ast
import builtins as _builtins
import hashlib as _hashlib
import hmac as _hmac
import importlib as _importlib
import json as _json
import os as _os
import sys as _sys
import threading as _threading
import types as _types

import pytest as _pytest_mod

_PATH = __PATH__
_NAME = __NAME__
_KEY = bytes.fromhex(__KEY__)
_TRUST_PATH = __TRUST__
_FD = _os.open(_PATH, _os.O_WRONLY | _os.O_APPEND)
_MAC = [b""]
# What the checks use, taken before any test module or code under test runs.
_compile = compile
_open = open
_getframe = _sys._getframe
_isinstance = isinstance
_FunctionType = _types.FunctionType
_CodeType = _types.CodeType
_sha1 = _hashlib.sha1


def _emit(**event):
    # Each line is chained to the last with a key only this process holds: a line
    # written by anything else breaks the chain.
    body = _json.dumps(event, sort_keys=True)
    _MAC[0] = _hmac.new(_KEY, _MAC[0] + body.encode(), _hashlib.sha256).hexdigest().encode()
    _os.write(_FD, (_json.dumps({"e": event, "mac": _MAC[0].decode()}) + "\n").encode())


try:
    with _open(_TRUST_PATH, "rb") as _f:
        _TRUST = _json.loads(_f.read())
except (OSError, ValueError):
    _TRUST = {}

# The key leaves the disk: the source (and any bytecode of it) is removed once imported.
for _p in (__file__, getattr(__spec__, "cached", None) or "", _TRUST_PATH):
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


# ------------------------------------------------------------------ trusted sources
# The grader read, before the patch applied, the git blob id of every Python file of the
# base commit with the test patch applied, less the files the patch changes. Code is
# trusted when its file still has that content; the tests' code must be the code this
# process compiles from those bytes itself.
_ROOT = _os.path.realpath(_TRUST.get("root") or _os.getcwd())
_BLOBS = dict(_TRUST.get("blobs") or {})
_TESTS = frozenset(_TRUST.get("tests") or ())
_CHECK_TESTS = bool(_TRUST)
for _rel in _TRUST.get("at_load") or ():  # the test patch did not apply to a temporary index
    try:
        with _open(_os.path.join(_ROOT, _rel), "rb") as _f:
            _data = _f.read()
        _BLOBS[_rel] = _sha1(b"blob %d\0" % len(_data) + _data).hexdigest()
    except OSError:
        pass
_SOURCES = {}
_INDEX = {}
_VERIFIED = {}
_RELS = {}
_BINDERS = {}
_NAMES = {}
_CONFIG = []


def _rel(filename):
    """``filename`` relative to the work tree, or None outside it."""
    if filename in _RELS:
        return _RELS[filename]
    out = None
    if filename and not filename.startswith("<"):
        path = _os.path.realpath(_os.path.join(_ROOT, filename))
        if path != _ROOT and path.startswith(_ROOT + _os.sep):
            out = path[len(_ROOT) + 1 :]
    _RELS[filename] = out
    return out


def _trusted_bytes(rel):
    """The file's bytes when they are the ones the grader trusts, else None."""
    if rel in _SOURCES:
        return _SOURCES[rel]
    data = None
    want = _BLOBS.get(rel)
    if want is not None:
        try:
            with _open(_os.path.join(_ROOT, rel), "rb") as f:
                raw = f.read()
        except OSError:
            raw = None
        if raw is not None and _sha1(b"blob %d\0" % len(raw) + raw).hexdigest() == want:
            data = raw
    _SOURCES[rel] = data
    return data


def _trusted_file(rel):
    return _trusted_bytes(rel) is not None


def _walk(code, out):
    out.setdefault((code.co_name, code.co_firstlineno), []).append(code)
    for const in code.co_consts:
        if _isinstance(const, _CodeType):
            _walk(const, out)


def _index(rel):
    """(name, first line) -> [(code, qualname)] of the file compiled as pytest would."""
    if rel in _INDEX:
        return _INDEX[rel]
    data = _trusted_bytes(rel)
    out = None
    if data is not None:
        out = {}
        path = _os.path.join(_ROOT, rel)
        variants = []
        try:
            variants.append(_compile(data, path, "exec", dont_inherit=True))
        except (SyntaxError, ValueError):
            pass
        try:
            from _pytest.assertion.rewrite import rewrite_asserts
        except ImportError:
            rewrite_asserts = None
        if rewrite_asserts is not None:
            for config in (None, *_CONFIG[:1]):
                try:
                    tree = _ast.parse(data)
                    rewrite_asserts(tree, data, path, config)
                    variants.append(_compile(tree, path, "exec", dont_inherit=True))
                except Exception:
                    pass
        for code in variants:
            _walk(code, out)
    _INDEX[rel] = out
    return out


def _trusted_code(code):
    """Why ``code`` is not compiled from a trusted file as it is ("" when it is, or is
    library code outside the work tree)."""
    if _VERIFIED.get(id(code)) is code:
        return ""
    rel = _rel(code.co_filename)
    if rel is None:
        return ""
    index = _index(rel)
    if index is None:
        if rel not in _BLOBS:
            return f"{code.co_name} comes from {rel}, which the patch changed or added"
        return f"{code.co_name} comes from {rel}, which is not as the task brought it"
    if any(known == code for known in index.get((code.co_name, code.co_firstlineno), ())):
        _VERIFIED[id(code)] = code  # code objects do not change: once is enough
        return ""
    return f"{code.co_name} ({rel}:{code.co_firstlineno}) is not the code {rel} compiles to"


def _codes(obj):
    """The code objects ``obj`` runs: through bound methods, descriptors and wrappers."""
    out = []
    seen = set()
    todo = [obj]
    while todo and len(seen) < 20:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        code = getattr(f, "__code__", None)
        if _isinstance(code, _CodeType):
            out.append(code)
        for attr in ("__func__", "__wrapped__", "fget", "fset", "func", "_fixture_function"):
            try:
                inner = getattr(f, attr, None)
            except Exception:
                inner = None
            if inner is not None:
                todo.append(inner)
    return out


def _def_names(rel):
    data = _trusted_bytes(rel)
    if data is None:
        return frozenset()
    try:
        tree = _ast.parse(data)
    except SyntaxError:
        return frozenset()
    return frozenset(
        n.name for n in _ast.walk(tree) if _isinstance(n, (_ast.FunctionDef, _ast.AsyncFunctionDef))
    )


def _check_test(item):
    """Why ``item`` would not run the task's test code ("" when it would)."""
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    rel_item = _rel(str(getattr(item, "path", None) or getattr(item, "fspath", "")))
    cls = getattr(item, "cls", None)
    runs = [("the collected function", getattr(item, "obj", None))]
    if cls is not None:
        for klass in getattr(cls, "__mro__", ()):
            if name in getattr(klass, "__dict__", {}):
                runs.append(("the class's attribute", klass.__dict__[name]))
                break
        case = getattr(item, "_testcase", None)
        if case is not None and name in getattr(case, "__dict__", {}):
            runs.append(("the test case's own attribute", case.__dict__[name]))
    for label, obj in runs:
        codes = _codes(obj)
        inner = [c for c in codes if _rel(c.co_filename) is not None]
        if not inner:
            return f"{item.nodeid}: {label} runs no code from the task's test files"
        for code in codes:
            why = _trusted_code(code)
            if why:
                return f"{item.nodeid}: {label} runs other code ({why})"
        code = inner[-1]
        if code.co_name != name and rel_item is not None and name in _def_names(rel_item):
            return f"{item.nodeid}: {label} runs {code.co_name} in place of {name}"
    return ""


def _binders(body, out):
    """Name -> the last statement of ``body`` (or of its blocks) that binds it."""
    for node in body:
        if _isinstance(node, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)):
            out[node.name] = node
            continue
        for sub in _ast.walk(node):
            if _isinstance(sub, _ast.Name) and _isinstance(sub.ctx, _ast.Store):
                out[sub.id] = node
            elif _isinstance(sub, _ast.alias):
                out[(sub.asname or sub.name).split(".")[0]] = node
            elif _isinstance(sub, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)):
                out[sub.name] = node
    return out


def _check_namespace(ns, body, rel, where, owner=""):
    """The module's (or class ``owner``'s) functions and classes are the trusted source's."""
    if id(body) not in _BINDERS:  # the trees are cached: their bodies live on
        _BINDERS[id(body)] = _binders(body, {})
    last = _BINDERS[id(body)]
    for node in body:
        if last.get(getattr(node, "name", None)) is not node:
            continue
        if _isinstance(node, (_ast.FunctionDef, _ast.AsyncFunctionDef)):
            key = node.name
            if owner and key.startswith("__") and not key.endswith("__"):
                key = "_" + owner.lstrip("_") + key  # name mangling
            live = ns.get(key)
            if live is None:
                return f"{where}{node.name} was removed"
            codes = _codes(live)
            if not codes and not node.decorator_list:
                return f"{where}{node.name} is not a function any more"
            for code in codes:
                why = _trusted_code(code)
                if why:
                    return f"{where}{node.name} was replaced ({why})"
            own = [c for c in codes if _rel(c.co_filename) == rel]
            if not node.decorator_list and not any(
                c.co_name == node.name and c.co_firstlineno == node.lineno for c in own
            ):
                return f"{where}{node.name} runs other code than its definition"
        elif _isinstance(node, _ast.ClassDef):
            live = ns.get(node.name)
            if not _isinstance(live, type):
                continue
            why = _check_namespace(
                live.__dict__, node.body, rel, f"{where}{node.name}.", node.name
            )
            if why:
                return why
            for attr, value in list(live.__dict__.items()):
                if _isinstance(value, _FunctionType):
                    for code in _codes(value):
                        why = _trusted_code(code)
                        if why:
                            return f"{where}{node.name}.{attr} was added or replaced ({why})"
    return ""


_TREES = {}


def _check_module(module, rel):
    if rel not in _TREES:
        data = _trusted_bytes(rel)
        try:
            _TREES[rel] = None if data is None else _ast.parse(data)
        except SyntaxError:
            _TREES[rel] = _ast.Module(body=[], type_ignores=[])
    tree = _TREES[rel]
    if tree is None:
        return f"the test file {rel} is not as the task brought it"
    return _check_namespace(getattr(module, "__dict__", {}), tree.body, rel, f"{rel}: ")


# ----------------------------------------------------------- the framework's machinery
_MODULES = (
    "unittest.case", "unittest.result", "unittest.suite", "unittest.util",
    "_pytest.runner", "_pytest.reports", "_pytest.python", "_pytest.unittest",
    "_pytest.skipping", "_pytest.main", "_pytest.terminal", "_pytest.nodes",
    "_pytest.fixtures", "_pytest.outcomes", "_pytest.python_api", "_pytest.raises",
    "_pytest.recwarn", "_pytest.warnings", "_pytest.assertion", "_pytest.assertion.rewrite",
    "_pytest.assertion.util", "_pytest.compat", "pluggy._callers", "pluggy._hooks",
    "pluggy._manager", "pluggy._result", "pytest", "builtins",
)
# Set by pytest itself around each test (its assertion plugin's hooks).
_MUTABLE = {
    ("_pytest.assertion.util", "_reprcompare"),
    ("_pytest.assertion.util", "_assertion_pass"),
    ("_pytest.assertion.util", "_config"),
}
_BUILTINS = (
    "__build_class__", "__import__", "compile", "exec", "eval", "isinstance", "issubclass",
    "AssertionError", "Exception", "BaseException", "type", "object", "getattr", "hasattr",
    "callable", "repr", "bool", "len", "all", "any", "super", "print",
)
_KINDS = (_FunctionType, classmethod, staticmethod, property, type, _types.BuiltinFunctionType)


def _framework():
    """The framework's functions and classes as found now.

    Returns ``{(module, attribute): (namespace, name, object, its code)}`` (the namespace
    is the live module or class dict, so a check is one lookup), ``{(module, class):
    (class, size of its dict)}`` and ``{module name: module}``.
    """
    out = {}
    classes = {}
    modules = {}
    for name in _MODULES:
        try:
            module = _importlib.import_module(name)
        except Exception:
            continue
        modules[name] = module
        items = vars(module).items()
        if name == "builtins":
            items = [(k, getattr(module, k)) for k in _BUILTINS if hasattr(module, k)]
        for attr, value in list(items):
            if (name, attr) in _MUTABLE or not _isinstance(value, _KINDS):
                continue
            out[(name, attr)] = (vars(module), attr, value, getattr(value, "__code__", None))
            if (
                _isinstance(value, type)
                and name != "builtins"
                and getattr(value, "__module__", "") == name
            ):
                space = vars(value)
                classes[(name, attr)] = (value, len(space))
                for sub, inner in list(space.items()):
                    if _isinstance(inner, _KINDS):
                        code = getattr(inner, "__code__", None)
                        out[(name, attr + "." + sub)] = (space, sub, inner, code)
    return out, classes, modules


def _flag(kind, what):
    if (kind, what) not in _FLAGGED:
        _FLAGGED.add((kind, what))
        _emit(event="tamper", kind=kind, what=what)


def _fast(frame):
    """The snapshot as flat lists (namespaces, names, objects; and for functions, codes)."""
    flat = ([], [], [], [], [], [])
    for space, attr, obj, code in frame.values():
        flat[0].append(space)
        flat[1].append(attr)
        flat[2].append(obj)
        if code is not None:
            flat[3].append(space)
            flat[4].append(attr)
            flat[5].append(code)
    return flat


def _unchanged(spaces, names, objs, fspaces, fnames, codes):
    # Identity, compared in C (map, operator.is_): no __eq__ of a replacement is called.
    try:
        return all(map(_is, map(_getitem, spaces, names), objs)) and all(
            map(_is, map(_code_of, map(_getitem, fspaces, fnames)), codes)
        )
    except (KeyError, AttributeError):
        return False


def _compare(additions):
    """Flag what changed since the last snapshot; ``additions``: new attributes pytest's
    own classes may get (while pytest configures itself)."""
    if not _unchanged(*_GROUPS):
        for key, (space, attr, obj, code) in _FRAMEWORK.items():
            value = space.get(attr)
            if value is not obj or (code is not None and value.__code__ is not code):
                _flag("pytest" if key[0] != "unittest.case" else "tests",
                      f"{key[0]}.{key[1]} was replaced")
    for name, module in _LOADED.items():
        if _sys.modules.get(name) is not module:
            _flag("pytest", f"the module {name} was replaced in sys.modules")
    for key, (klass, size) in _CLASSES.items():
        space = vars(klass)
        if len(space) == size:
            continue
        for sub, inner in list(space.items()):
            if not _isinstance(inner, _KINDS) or (key[0], key[1] + "." + sub) in _FRAMEWORK:
                continue
            if additions and key[0].startswith("_pytest."):
                continue
            _flag("tests" if key[0].startswith("unittest") else "pytest",
                  f"{key[0]}.{key[1]}.{sub} was added")
    for hook, value in _hooks().items():
        if value is not _HOOKS[hook]:
            _flag("tests", f"a hook was installed with {hook} during the session")


def _hooks():
    hooks = {
        "sys.settrace": _sys.gettrace(),
        "sys.setprofile": _sys.getprofile(),
        "threading.settrace": getattr(_threading, "_trace_hook", None),
        "threading.setprofile": getattr(_threading, "_profile_hook", None),
    }
    monitoring = getattr(_sys, "monitoring", None)
    if monitoring is not None:
        for tool in range(6):
            hooks[f"sys.monitoring tool {tool}"] = monitoring.get_tool(tool)
    return hooks


# ------------------------------------------------ objects that compare equal to anything
class _Unrelated:
    """A fresh object no code under test has seen: nothing should compare equal to it."""

    __slots__ = ()


_Unrelated.__name__ = _Unrelated.__qualname__ = "_Unrelated" + _NAME[-8:]


def _accepts_anything(obj):
    """Where ``obj``'s type's ``__eq__`` lives, when it is the repository's and says yes."""
    eq = None
    for klass in getattr(type(obj), "__mro__", ()):
        if "__eq__" in klass.__dict__:
            eq = klass.__dict__["__eq__"]
            break
    code = getattr(eq, "__code__", None)
    if not _isinstance(code, _CodeType):
        return ""
    rel = _rel(code.co_filename)
    if rel is None or rel in _TESTS:
        return ""
    probe = _Unrelated()
    try:
        same = bool(obj == probe) or not bool(obj != probe)
    except Exception:
        return ""
    if not same:
        return ""
    return f"{type(obj).__qualname__} (__eq__ at {rel}:{code.co_firstlineno})"


# Checked by unittest's assertEqual: its operands, after the comparison passed.
_assert_equal = __import__("unittest").case.TestCase.assertEqual


def _checked_assert_equal(self, first, second, msg=None):
    _assert_equal(self, first, second, msg)
    if _STATE:
        for operand in (first, second):
            what = _accepts_anything(operand)
            if what:
                _STATE[0].equal(f"assertEqual in {self.id()} passed on a {what}")
                break


_checked_assert_equal.__wrapped__ = _assert_equal
_checked_assert_equal.__name__ = "assertEqual"
_checked_assert_equal.__qualname__ = "TestCase.assertEqual"
__unittest = True  # unittest leaves this module's frames out of its failure reports
__import__("unittest").case.TestCase.assertEqual = _checked_assert_equal
# unittest hands a SkipTest raised in a test to _addSkip while it is handled: pytest
# then sees only the skip's reason, so who raised it is read here.
_unittest_case = __import__("unittest").case
_add_skip = getattr(_unittest_case, "_addSkip", None)


def _checked_add_skip(result, test_case, reason):
    exc = _sys.exc_info()[1]
    if _STATE and exc is not None:
        where = _who_raised(exc.__traceback__)
        if where is not None and not _trusted_file(where[0]):
            _flag("tests", f"{test_case.id()} was skipped by {where[0]}:{where[1]}")
    return _add_skip(result, test_case, reason)


if _add_skip is not None:
    _unittest_case._addSkip = _checked_add_skip
_STATE = []
_FLAGGED = set()
# Taken as the plugin loads (before any conftest, test module or code under test), and
# again when the session starts: pytest's own plugins add attributes to its classes
# while configuring (legacypath's fspath, startdir...), nothing may replace one.
_is = __import__("operator").is_
_getitem = __import__("operator").getitem
_code_of = __import__("operator").attrgetter("__code__")
_FRAMEWORK, _CLASSES, _LOADED = _framework()
_GROUPS = _fast(_FRAMEWORK)
_HOOKS = _hooks()
_FUNCS = {id(v[2]) for v in _FRAMEWORK.values() if _isinstance(v[2], _FunctionType)}
_BUSY = [False]
_AUDITED = frozenset({
    "sys.settrace", "sys.setprofile", "object.__setattr__", "sys.monitoring.register_callback",
    "sys._settraceallthreads", "sys._setprofileallthreads",
})
_CODE_ATTRS = frozenset({"__code__", "__defaults__", "__kwdefaults__"})


_SELF = _rel(__file__)


def _untrusted_caller():
    """The first frame on the stack that runs code the grader does not trust."""
    frame = _getframe(2)
    while frame is not None:
        rel = _rel(frame.f_code.co_filename)
        if rel is not None and rel != _SELF and not _trusted_file(rel):
            return f"{rel}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def _audit(event, args):
    # Calls that install trace or profile functions, and changes to the code of a test's
    # or the framework's functions, made by code the grader does not trust, as they
    # happen: a change undone before the next check is seen too. (Class attributes raise
    # no audit event: those are compared before each test and at the end.)
    if event not in _AUDITED or _BUSY[0]:
        return
    if event == "object.__setattr__":
        target, attr = args[0], args[1]
        if not _isinstance(target, _FunctionType) or attr not in _CODE_ATTRS:
            return
        rel = _rel(target.__code__.co_filename)
        if id(target) not in _FUNCS and (rel is None or rel not in _BLOBS):
            return
        what = f"{target.__qualname__}.{attr} was replaced"
    else:
        what = f"{event} was called"
    _BUSY[0] = True
    try:
        where = _untrusted_caller()
    finally:
        _BUSY[0] = False
    if where:
        _flag("tests", f"{what} by {where}")


_sys.addaudithook(_audit)
_OWNER = []
_emit(event="load", pid=_os.getpid(), trusted=len(_BLOBS))


_SKIP_MARKS = ("skip", "skipif", "xfail")
_OUTCOMES = tuple(
    c
    for c in (
        getattr(_pytest_mod.skip, "Exception", None),
        getattr(_pytest_mod.xfail, "Exception", None),
        __import__("unittest").SkipTest,
    )
    if c is not None
)


def _marks(item):
    """What can make ``item`` skip or xfail without failing: its markers, unittest's flags."""
    out = []
    for mark in item.iter_markers():
        if mark.name in _SKIP_MARKS:
            out.append((mark.name, repr(mark.args)[:300], repr(sorted(mark.kwargs.items()))[:300]))
    for owner in (getattr(item, "obj", None), getattr(item, "cls", None)):
        for flag in ("__unittest_skip__", "__unittest_expecting_failure__"):
            value = getattr(owner, flag, None) if owner is not None else None
            if value:
                out.append((flag, repr(value)[:50], ""))
    return tuple(out)


def _who_raised(tb):
    """The innermost frame of the work tree (not this plugin) in the traceback ``tb``."""
    where = None
    while tb is not None:
        rel = _rel(tb.tb_frame.f_code.co_filename)
        if rel is not None and rel != _SELF:
            where = (rel, tb.tb_lineno)
        tb = tb.tb_next
    return where


class _Recorder:
    def __init__(self, config):
        self.config = config
        self.known = set()
        self.modules = {}

    def flag(self, kind, what):
        _flag(kind, what)

    def equal(self, what):
        _flag("equal", what)

    def _tampered(self):
        _compare(False)
        pm = self.config.pluginmanager
        for hook in _SENSITIVE:
            caller = getattr(pm.hook, hook, None)
            if caller is None:
                continue
            for impl in caller.get_hookimpls():
                plugin = impl.plugin
                if id(plugin) in self.known:
                    continue
                if _os.path.basename(getattr(plugin, "__file__", "") or "") == "conftest.py":
                    continue
                _flag("pytest", f"plugin {impl.plugin_name!r} implementing {hook} "
                      "was registered during the session")

    def _check_hooks(self):
        pm = self.config.pluginmanager
        for hook, start in getattr(self, "impls", {}).items():
            now = {(id(i.plugin), i.function) for i in getattr(pm.hook, hook).get_hookimpls()}
            if start - now:
                self.flag("pytest", f"an implementation of {hook} was removed during the session")

    def _check_items(self, items):
        collected = getattr(self, "marks", {})
        for item in items:
            if item.nodeid in collected and _marks(item) != collected[item.nodeid]:
                self.flag("tests", f"{item.nodeid}: its skip or xfail markers changed")
            for attr, value in list(vars(item).items()):
                if callable(value) and any(
                    _isinstance(k.__dict__.get(attr), _FunctionType) for k in type(item).__mro__
                ):
                    self.flag("pytest", f"{item.nodeid}: the item's own {attr} replaces pytest's")
        if not _CHECK_TESTS:
            return
        for item in items:
            if not _isinstance(item, _pytest_mod.Function):
                continue
            module = getattr(item, "module", None)
            rel = _rel(str(getattr(item, "path", None) or getattr(item, "fspath", "")))
            if rel is None:
                self.flag("tests", f"{item.nodeid} is not in the work tree")
                continue
            if module is not None:
                self.modules[id(module)] = (module, rel)
            why = _check_test(item)
            if why:
                self.flag("tests", why)
        mods = {id(getattr(i, "module", None)) for i in items}
        for key, (module, rel) in list(self.modules.items()):
            if key in mods:
                why = _check_module(module, rel)
                if why:
                    self.flag("tests", why)

    def _check(self, items):
        self._tampered()
        self._check_hooks()
        self._check_items(items)

    @_pytest_mod.hookimpl(trylast=True)
    def pytest_sessionstart(self, session):
        global _FRAMEWORK, _CLASSES, _LOADED, _GROUPS
        self.known = {id(p) for p in self.config.pluginmanager.get_plugins()}
        _compare(True)
        _FRAMEWORK, _CLASSES, _LOADED = _framework()
        _GROUPS = _fast(_FRAMEWORK)
        _FUNCS.update(id(v[2]) for v in _FRAMEWORK.values() if _isinstance(v[2], _FunctionType))
        _emit(event="start")

    def pytest_collection_finish(self, session):
        _emit(event="collected", ids=[item.nodeid for item in session.items])
        self.items = list(session.items)
        pm = self.config.pluginmanager
        self.impls = {
            hook: {(id(i.plugin), i.function) for i in getattr(pm.hook, hook).get_hookimpls()}
            for hook in _SENSITIVE
            if getattr(pm.hook, hook, None) is not None
        }
        self.marks = {item.nodeid: _marks(item) for item in self.items}
        _STATE.append(self)
        self._check(self.items)

    @_pytest_mod.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item):
        # Before each test's body runs (its fixtures set up): what changed during the
        # tests before it, or during its setup.
        self._check([item])

    @_pytest_mod.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        # A skip or an xfail (which FAIL_TO_PASS counts as a pass, and PASS_TO_PASS a
        # skip as kept) must come from the task's tests: a marker they had when
        # collected, or pytest.skip/xfail called from trusted code.
        excinfo = call.excinfo  # before pytest's unittest plugin turns a SkipTest into its own
        outcome = yield
        rep = outcome.get_result()
        xfail = hasattr(rep, "wasxfail")
        if not (rep.skipped or xfail):
            return
        kind = "xfailed" if xfail else "skipped"
        where = None
        if excinfo is not None and _isinstance(excinfo.value, _OUTCOMES):
            where = _who_raised(excinfo.tb)  # None: raised by pytest or unittest themselves
            if where is not None and not _trusted_file(where[0]):
                self.flag("tests", f"{item.nodeid} was {kind} by {where[0]}:{where[1]}")
        if where is None and xfail and not any(
            m[0] in ("xfail", "__unittest_expecting_failure__")
            for m in getattr(self, "marks", {}).get(item.nodeid, ())
        ):
            self.flag("tests", f"{item.nodeid} is reported xfailed with no xfail marker of its own")

    def pytest_assertion_pass(self, item, lineno, orig, expl):
        # The operands of a plain assert pytest rewrote: its temporaries and the names in it.
        frame = _getframe(1)
        while frame is not None and "@pytest_ar" not in frame.f_globals:
            frame = frame.f_back
        if frame is None:
            return
        values = [v for k, v in frame.f_locals.items() if k.startswith("@py_assert")]
        names = _NAMES.get(orig)
        if names is None:
            try:
                tree = _ast.parse(orig)
                names = _NAMES[orig] = {n.id for n in _ast.walk(tree) if _isinstance(n, _ast.Name)}
            except SyntaxError:
                names = _NAMES[orig] = set()
        values += [frame.f_locals[n] for n in names if n in frame.f_locals]
        for value in values:
            what = _accepts_anything(value)
            if what:
                where = _rel(frame.f_code.co_filename) or frame.f_code.co_filename
                self.equal(f"the assertion at {where}:{lineno} passed on a {what}")
                return

    def pytest_runtest_logreport(self, report):
        _emit(event="report", id=report.nodeid, when=report.when, outcome=report.outcome,
              xfail=hasattr(report, "wasxfail"))

    def pytest_sessionfinish(self, session, exitstatus):
        self._check(getattr(self, "items", []))
        _emit(event="finish", exitstatus=int(exitstatus))


_SENSITIVE = ("pytest_runtest_makereport", "pytest_runtest_protocol", "pytest_runtest_call",
              "pytest_pyfunc_call", "pytest_report_teststatus", "pytest_runtest_logreport",
              "pytest_runtestloop", "pytest_runtest_setup", "pytest_runtest_teardown",
              "pytest_terminal_summary", "pytest_collection_modifyitems",
              "pytest_assertion_pass")


def pytest_configure(config):
    if _OWNER:  # a nested in-process session (pytester): not the graded one
        return
    _OWNER.append(config)
    _CONFIG.append(config)
    config.pluginmanager.register(_Recorder(config), "branchgym-outcome-recorder")
'''


def uses_pytest(task: SWEBenchTask) -> bool:
    """Whether ``task``'s tests run under pytest (its log parser reads pytest's output)."""
    from branchgym.envs.swebench import harness

    return harness.log_parser_name(task) in PYTEST_PARSERS


def blob_id(data: bytes) -> str:
    """The git blob id of ``data`` (what ``git hash-object`` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclasses.dataclass(frozen=True)
class Trust:
    """What the recorder trusts, read by the grader before the patch applies.

    Attributes:
        root: The work tree as the tests see it (``/testbed``).
        blobs: Each Python file of the base commit, with the test patch applied, as its
            git blob id; less the files the patch changes (other than the test patch's,
            which the eval script restores). Code from a file whose content is not its
            blob here is not trusted, and a test's code must be what the recorder
            compiles from those bytes itself.
        tests: The test patch's files.
        at_load: Test patch files whose blob could not be read in advance (the test
            patch did not apply to a temporary index): the recorder reads them when it
            loads, after the eval script applied the test patch and before any test
            module or code under test runs.
    """

    root: str
    blobs: Mapping[str, str]
    tests: tuple[str, ...] = ()
    at_load: tuple[str, ...] = ()

    def to_json(self) -> str:
        """The form the plugin reads."""
        return json.dumps(
            {
                "root": self.root,
                "blobs": dict(self.blobs),
                "tests": list(self.tests),
                "at_load": list(self.at_load),
            }
        )


#: Blob ids of the base commit's Python files, then those of the test patch's files once
#: it applies to a temporary index (the work tree and the repository's index untouched).
_TRUST_SCRIPT = r"""
set -e
t=$(mktemp -d); trap 'rm -rf "$t"' EXIT
export GIT_INDEX_FILE="$t/index" GIT_NO_REPLACE_OBJECTS=1 LC_ALL=C
git -c core.quotepath=off ls-tree -r --full-tree {base} | grep -E '\.py$' || true
echo '>>>>> test patch'
git read-tree {base}
if git apply --cached {patch} 2>"$t/err"; then
  git -c core.quotepath=off ls-files -s -- {tests}
else
  echo '>>>>> not applied'; cat "$t/err"
fi
rm -f {patch} || true
"""


def trusted_sources(
    sandbox: Sandbox, task: SWEBenchTask, patch: str, *, timeout: float = 120.0
) -> Trust:
    """Read :class:`Trust` from ``sandbox`` at the base commit, before ``patch`` applies.

    Raises:
        SandboxError: git could not list the base commit (its output is in the message).
    """
    import shlex

    from branchgym.envs.swebench import guard
    from branchgym.envs.swebench.tasks import diff_files
    from branchgym.error import SandboxError

    tests = tuple(diff_files(task.test_patch))
    name = f".git/branchgym-trust-{secrets.token_hex(6)}.patch"
    sandbox.write(name, task.test_patch.encode())
    script = _TRUST_SCRIPT.format(
        base=shlex.quote(task.base_commit),
        patch=shlex.quote(name),
        tests=" ".join(shlex.quote(t) for t in tests) or "''",
    )
    res = sandbox.exec(script, cwd=sandbox.workdir, timeout=timeout)
    if res.exit_code != 0:
        raise SandboxError(
            "could not list the base commit's files for the outcome recorder (is "
            f"{task.base_commit} in the sandbox's repository?): {res.text[-2000:]}"
        )
    base_part, _, test_part = res.text.partition(">>>>> test patch\n")
    blobs: dict[str, str] = {}
    for line in base_part.splitlines():
        meta, sep, path = line.partition("\t")
        words = meta.split()
        if sep and len(words) == 3 and words[1] == "blob":
            blobs[path] = words[2]
    at_load: tuple[str, ...] = ()
    if test_part.startswith(">>>>> not applied"):
        at_load = tests
    else:
        for line in test_part.splitlines():
            meta, sep, path = line.partition("\t")
            words = meta.split()
            if sep and len(words) == 3:
                blobs[path] = words[1]
    for path in set(guard.patch_paths(patch)) - set(tests):
        blobs.pop(path, None)
    for path in at_load:
        blobs.pop(path, None)
    return Trust(sandbox.workdir, blobs, tests, at_load)


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
        """``base`` with the plugin named in ``PYTEST_ADDOPTS`` and its folder on ``PYTHONPATH``.

        pytest's assertion-pass hook is turned on (:data:`PASS_HOOK_OPTION`): the
        recorder reads the operands of each passing assertion.
        """
        env = dict(base)
        env["PYTEST_ADDOPTS"] = " ".join(
            filter(None, [env.get("PYTEST_ADDOPTS", ""), f"-p {self.name}", PASS_HOOK_OPTION])
        )
        env["PYTHONPATH"] = ":".join(
            filter(None, [f"{workdir}/{self.folder}", env.get("PYTHONPATH", "")])
        )
        return env


#: Turns on pytest's ``pytest_assertion_pass`` hook (pytest 5 and later).
PASS_HOOK_OPTION = "-o enable_assertion_pass_hook=true"


def install(sandbox: Sandbox, trust: Trust) -> Recorder:
    """Write the plugin, what it trusts and an empty record into ``sandbox`` (under ``.git/``).

    ``trust``: from :func:`trusted_sources`, read before the patch applied.
    """
    token = secrets.token_hex(8)
    key = secrets.token_hex(32)
    name = f"_branchgym_outcomes_{token}"
    folder = f".git/branchgym-{token}"
    report = f"{folder}/{token}.jsonl"
    trust_file = f"{folder}/{token}.trust.json"
    path = f"{sandbox.workdir}/{report}"
    sandbox.write(report, b"", mode=0o666)
    sandbox.write(trust_file, trust.to_json().encode(), mode=0o666)
    source = (
        PLUGIN_SOURCE.replace("__PATH__", repr(path))
        .replace("__NAME__", repr(name))
        .replace("__KEY__", repr(key))
        .replace("__TRUST__", repr(f"{sandbox.workdir}/{trust_file}"))
    )
    sandbox.write(f"{folder}/{name}.py", source.encode(), mode=0o644)
    # The tests may run as another user than the one who wrote the files, and the
    # plugin removes its source (which holds the key) and what it trusts once imported.
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


#: What each kind of tamper event means, in the order they are reported.
_TAMPER = {
    "pytest": "the test run tampered with pytest's reporting: ",
    "tests": "the tests that ran are not the task's tests as it brought them: ",
    "equal": "a passing assertion compared an object that says it equals anything: ",
}


def check(
    record: str,
    task: SWEBenchTask,
    status_map: Mapping[str, str],
    parse: Any = None,
    key: str = "",
    trust: Trust | None = None,
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
        trust: What the recorder was given to trust (:func:`install`): it must have read
            all of it, or its checks of the tests' code did not run.
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
    if trust is not None:
        loaded = next(e for e in events if e.get("event") == "load")
        want = len(trust.blobs) + len(trust.at_load)
        if loaded.get("trusted") != want:
            return (
                f"the outcome recorder read {loaded.get('trusted')} trusted files of {want}: "
                "its checks of the tests' code could not run"
            )
    tamper: dict[str, list[str]] = {}
    for e in events:
        if e.get("event") == "tamper":
            tamper.setdefault(str(e.get("kind", "pytest")), []).append(str(e.get("what")))
    for kind, intro in _TAMPER.items():
        if kind in tamper:
            more = len(tamper[kind]) - 3
            return intro + "; ".join(tamper[kind][:3]) + (f" (and {more} more)" if more > 0 else "")
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
