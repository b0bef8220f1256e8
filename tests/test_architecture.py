"""Import arrows run one way: env -> snapshot -> tree -> rows -> loss -> learner.

These tests read the source with :mod:`ast` (no imports run), so a lazy import inside a
function counts the same as one at the top of a module.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Source folders and the package each is installed as (see pyproject's package-dir).
PACKAGES = {
    "branchgym": "branchgym",
    "agents": "branchgym.agents",
    "wrappers": "branchgym.wrappers",
    "scenarios": "branchgym.scenarios",
}


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [*PACKAGES[rel.parts[0]].split("."), *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(*folders: str):
    """Our modules: shipped data (upstream repositories, task sources) lives in data/."""
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path


def imports(path: pathlib.Path):
    """``(line, imported module, imported names)`` for every import in ``path``."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield node.lineno, module, tuple(alias.name for alias in node.names)


def is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_module_names_map_the_source_folders():
    assert module_name(ROOT / "agents" / "policy.py") == "branchgym.agents.policy"
    assert module_name(ROOT / "branchgym" / "bench" / "__init__.py") == "branchgym.bench"


#: The engine: every module of ``branchgym/`` except the package's front door
#: (``__init__.py``, which registers the built-in envs by entry-point strings; the engine
#: may ``import branchgym`` to make an env by id), the CLI, ``bench/``, ``envs/`` and
#: ``integrations/`` (branchgym inside other trainers, which builds on the learners).
#: The command lines (cli.py, serve/command.py) parse arguments with bench/common.py.
ENGINE_EXCLUDED = {"branchgym/__init__.py", "branchgym/cli.py", "branchgym/serve/command.py"}
ENGINE_EXCLUDED_FOLDERS = {"bench", "envs", "integrations"}

#: What builds on the engine; the engine imports none of it. Each is named both as
#: installed (``branchgym.wrappers``) and as its source folder (``wrappers``), which a
#: checkout's root makes importable too.
ABOVE_ENGINE = {
    "branchgym.agents": "agents",
    "branchgym.wrappers": "wrappers",
    "branchgym.scenarios": "scenarios",
    "branchgym.bench": None,
    "branchgym.envs": None,
}

#: Known upward arrows, each with the change that removes it. The test fails when one is
#: gone, so the list only shrinks.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def engine_files():
    for path in source_files("branchgym"):
        rel = path.relative_to(ROOT)
        if rel.as_posix() in ENGINE_EXCLUDED or rel.parts[1] in ENGINE_EXCLUDED_FOLDERS:
            continue
        yield path


def upward_imports(files, above):
    """``(file, line, module)`` for every import of ``files`` that reaches into ``above``."""
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line, module, names in imports(path):
            targets = [module] + [f"{module}.{name}" for name in names]
            for package, folder in above.items():
                roots = [package] + ([folder] if folder else [])
                if any(is_under(t, root) for t in targets for root in roots):
                    yield rel, line, module
                    break


def test_engine_files_are_the_core_modules():
    rels = {p.relative_to(ROOT).as_posix() for p in engine_files()}
    core = {"branchgym/core.py", "branchgym/fidelity/suite.py", "branchgym/fidelity/violation.py"}
    assert core <= rels
    assert not {r for r in rels if r.startswith(("branchgym/bench/", "branchgym/envs/"))}
    assert not rels & ENGINE_EXCLUDED


def test_upward_import_check_sees_every_spelling(tmp_path, monkeypatch):
    """Absolute, relative, ``from branchgym import wrappers`` and the bare folder name."""
    pkg = tmp_path / "branchgym"
    pkg.mkdir()
    spellings = {
        "a.py": "from branchgym.wrappers.fidelity import FidelityCheck\n",
        "b.py": "from .envs import toy\n",
        "c.py": "from branchgym import bench\n",
        "d.py": "def f():\n    import wrappers.fidelity\n",
        "e.py": "from branchgym import core, error\n",
    }
    for name, text in spellings.items():
        (pkg / name).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)  # module_name() reads ROOT
    found = {rel for rel, _, _ in upward_imports(sorted(pkg.glob("*.py")), ABOVE_ENGINE)}
    assert found == {"branchgym/a.py", "branchgym/b.py", "branchgym/c.py", "branchgym/d.py"}


def test_engine_imports_nothing_above_it():
    """The engine never imports agents/, wrappers/, scenarios/, bench/ or envs/.

    Policies, losses, learners, wrappers, envs and studies build on the engine; the engine
    only knows the policy protocol (:mod:`branchgym.rollout.policy`), the snapshot protocol
    (:mod:`branchgym.core`) and the fidelity record (:mod:`branchgym.fidelity.violation`).
    """
    found = {
        (rel, module): line for rel, line, module in upward_imports(engine_files(), ABOVE_ENGINE)
    }
    offenders = [
        f"{rel}:{line}: {module}"
        for (rel, module), line in found.items()
        if (rel, module) not in KNOWN_UPWARD
    ]
    assert not offenders, "engine modules import what builds on them:\n" + "\n".join(offenders)
    stale = KNOWN_UPWARD - set(found)
    assert not stale, f"known upward imports are gone, drop them from KNOWN_UPWARD: {stale}"


#: The engine's subpackages, each named by its step of the data path. They are engine
#: modules like the top-level ones, and none has a known upward arrow.
ENGINE_SUBPACKAGES = ("fidelity", "rollout")


def test_engine_subpackages_import_nothing_above_the_engine():
    """fidelity/ and rollout/ import neither wrappers/, envs/ nor bench/ (nor agents/).

    The online wrapper (``wrappers/fidelity.py``) builds on ``branchgym.fidelity``, never
    the reverse; no exception is allowed here, KNOWN_UPWARD included.
    """
    engine = set(engine_files())
    for sub in ENGINE_SUBPACKAGES:
        files = list(source_files(f"branchgym/{sub}"))
        assert (ROOT / "branchgym" / sub / "__init__.py") in files
        assert set(files) <= engine, f"branchgym/{sub}/ is left out of the engine"
        assert sub not in ENGINE_EXCLUDED_FOLDERS
        offenders = [
            f"{rel}:{line}: {module}" for rel, line, module in upward_imports(files, ABOVE_ENGINE)
        ]
        assert not offenders, f"branchgym/{sub}/ imports what builds on it:\n" + "\n".join(
            offenders
        )


def test_wrappers_import_neither_envs_nor_what_builds_on_them():
    """Wrappers work on any Gymnasium env: they import the engine only."""
    above = {k: v for k, v in ABOVE_ENGINE.items() if k != "branchgym.wrappers"}
    offenders = [
        f"{rel}:{line}: {module}"
        for rel, line, module in upward_imports(source_files("wrappers"), above)
    ]
    assert not offenders, "wrappers import envs, scenarios, bench or agents:\n" + "\n".join(
        offenders
    )


def test_env_packages_import_nothing_from_bench():
    """Benchmarks import envs, never the reverse (env CLIs aside, like the top-level CLI)."""
    offenders = []
    for path in source_files("branchgym/envs"):
        rel = path.relative_to(ROOT)
        if rel.name == "cli.py":
            continue
        for line, module, _ in imports(path):
            if is_under(module, "branchgym.bench"):
                offenders.append(f"{rel}:{line}: {module}")
    assert not offenders, "env modules import the bench package:\n" + "\n".join(offenders)


def test_no_private_names_cross_module_boundaries():
    """``from branchgym.x import _name`` only inside ``branchgym.x`` itself.

    What one module needs from another is public and documented there (tests may still
    import privates). Covers branchgym/ (swebench included), agents/, wrappers/ and
    scenarios/.
    """
    offenders = []
    for path in source_files(*PACKAGES):
        me = module_name(path)
        for line, module, names in imports(path):
            if not is_under(module, "branchgym") or module == me:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                rel = path.relative_to(ROOT)
                offenders.append(f"{rel}:{line}: from {module} import {', '.join(private)}")
    assert not offenders, "private names imported across modules:\n" + "\n".join(offenders)


def test_no_module_keeps_an_alias_of_its_own_names():
    """``Old = New`` for a function or class of the same module: a former name.

    There has been no release, so a renamed or moved name updates its callers instead.
    """
    offenders = []
    for path in source_files(*PACKAGES):
        tree = ast.parse(path.read_text())
        defined = {
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                # a registry entry (EXECUTORS["fleet"] = FleetExecutor) is not an alias
                and all(isinstance(t, ast.Name) for t in node.targets)
                and isinstance(node.value, ast.Name)
                and node.value.id in defined
            ):
                names = ", ".join(ast.unparse(t) for t in node.targets)
                offenders.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {names} = {node.value.id}"
                )
    assert not offenders, "aliases of former names:\n" + "\n".join(offenders)


def test_long_modules_say_why_at_the_top():
    """A module over about 600 lines gives its reason in its docstring.

    branchgym/envs/swebench/ is left out: it is owned and sized separately.
    """
    offenders = []
    for path in source_files(*PACKAGES):
        rel = path.relative_to(ROOT)
        if rel.parts[:3] == ("branchgym", "envs", "swebench"):
            continue
        text = path.read_text()
        if text.count("\n") > 650:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "over 600 lines" not in doc:
                offenders.append(f"{rel}: {text.count(chr(10))} lines")
    assert not offenders, "long modules without a reason at the top:\n" + "\n".join(offenders)


def test_the_source_papers_figures_live_in_one_module():
    """The headline figures studies compare against are read from bench/source.py.

    Numbers in code only: docstrings may quote them as prose.
    """
    figures = {1920.0, 42.0, 138.0, 0.42, 0.58, 0.312, 0.191, 0.006, 0.024, 0.042}
    offenders = []
    for path in sorted((ROOT / "branchgym" / "bench").glob("*.py")):
        if path.name == "source.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
                if not isinstance(node.value, bool) and float(node.value) in figures:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not offenders, "source figures written as literals:\n" + "\n".join(offenders)
