"""Import arrows run one way: env -> snapshot -> tree -> rows -> loss -> learner.

These tests read the source with :mod:`ast` (no imports run), so a lazy import inside a
function counts the same as one at the top of a module. The rules:

* layers, bottom up: the engine, ``wrappers/``, ``envs/``, ``scenarios/``, ``agents/``,
  ``integrations/``, ``bench/``, then the front door (the package's ``__init__.py``, the
  CLI); a module imports its own layer or lower ones (:data:`LAYERS`);
* inside ``agents/``, subpackages by job, bottom up: ``policies``, ``engines``,
  ``estimators``, ``forward``, ``training``, ``learners``, then the modules that pick a
  learner by name (:data:`AGENT_LAYERS`); learners never import each other;
* no import loops anywhere: where two modules need each other, the shared piece moves
  down (:func:`import_loops`).
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
    policy = ROOT / "agents" / "policies" / "policy.py"
    assert module_name(policy) == "branchgym.agents.policies.policy"
    assert module_name(ROOT / "branchgym" / "bench" / "__init__.py") == "branchgym.bench"


#: The engine: every module of ``branchgym/`` except the package's front door
#: (``__init__.py``, which registers the built-in envs by entry-point strings; the engine
#: may ``import branchgym`` to make an env by id), the CLI, ``bench/``, ``envs/`` and
#: ``integrations/`` (branchgym inside other trainers, which builds on the learners).
#: The command lines (cli.py, serve/command.py) parse arguments with bench/common.py.
ENGINE_EXCLUDED = {"branchgym/__init__.py", "branchgym/cli.py", "branchgym/serve/command.py"}
ENGINE_EXCLUDED_FOLDERS = {"bench", "envs", "evaluation", "integrations"}

#: What builds on the engine; the engine imports none of it. Each is named both as
#: installed (``branchgym.wrappers``) and as its source folder (``wrappers``), which a
#: checkout's root makes importable too.
ABOVE_ENGINE = {
    "branchgym.agents": "agents",
    "branchgym.wrappers": "wrappers",
    "branchgym.scenarios": "scenarios",
    "branchgym.bench": None,
    "branchgym.envs": None,
    "branchgym.evaluation": None,
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


#: Layers bottom up: a module may import modules of its own layer or of a lower one.
#: ``evaluation/`` (``branchgym eval``) measures agents built from ``agents/``;
#: ``integrations/`` (branchgym inside other trainers) builds on the learners; ``bench/``
#: (studies) on everything; the front door (the package's ``__init__.py``, the CLI, the
#: ``serve`` command) sits on top.
LAYERS = (
    "engine",
    "wrappers",
    "envs",
    "scenarios",
    "agents",
    "evaluation",
    "integrations",
    "bench",
    "front",
)

#: ``agents/`` subpackages bottom up (``top``: the package's own modules, ``train`` and
#: ``gradient_probe``, which pick a learner by name).
AGENT_LAYERS = ("policies", "engines", "estimators", "forward", "training", "learners", "top")

#: The root package (``branchgym/__init__.py``) registers the built-in envs by entry-point
#: strings; any module may ``import branchgym`` to make an env by id, so arrows into the
#: root are not layer or loop arrows.
ROOT_PACKAGE = "branchgym"


def layer(module: str) -> tuple[int, int]:
    """``(layer, agents sub-layer)`` of a module of ours (sub-layer 0 outside agents/)."""
    parts = module.split(".")
    if module in (ROOT_PACKAGE, "branchgym.cli", "branchgym.serve.command"):
        return LAYERS.index("front"), 0
    top = parts[1] if len(parts) > 1 else ""
    if top == "agents":
        sub = parts[2] if len(parts) > 3 else "top"
        sub = sub if sub in AGENT_LAYERS else "top"
        return LAYERS.index("agents"), AGENT_LAYERS.index(sub)
    if top in LAYERS:
        return LAYERS.index(top), 0
    return LAYERS.index("engine"), 0


def import_graph(files) -> dict[str, dict[str, int]]:
    """``{module: {imported module of ours: line}}`` over ``files``.

    ``from pkg import name`` points at ``pkg.name`` when that is a module of ours, else at
    ``pkg`` (its ``__init__``); an import of the bare folder (``agents.x``) counts as the
    installed name. Arrows into :data:`ROOT_PACKAGE` are left out.
    """
    files = list(files)
    known = {module_name(p) for p in files}

    def resolve(name: str) -> str | None:
        for folder, package in PACKAGES.items():
            if folder != package and (name == folder or name.startswith(folder + ".")):
                name = package + name[len(folder) :]
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for path in files:
        me = module_name(path)
        out = graph.setdefault(me, {})
        for line, module, names in imports(path):
            targets = [f"{module}.{n}" for n in names] if names else [module]
            for target in targets:
                hit = resolve(target)
                if hit and hit not in (me, ROOT_PACKAGE):
                    out.setdefault(hit, line)
    return graph


def import_loops(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every set of modules that import each other (strongly connected, size > 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return loops


def upward_arrows(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports from a lower layer (or agents sub-layer) into a higher one, and learner ->
    learner."""
    found = []
    for src, targets in sorted(graph.items()):
        for dst, line in sorted(targets.items()):
            if layer(dst) > layer(src):
                found.append(f"{src}:{line} -> {dst}")
            elif layer(src) == layer(dst) == layer("branchgym.agents.learners.x"):
                found.append(f"{src}:{line} -> {dst} (learners never import each other)")
    return found


def test_layers_name_every_agents_subpackage():
    subs = {p.name for p in (ROOT / "agents").iterdir() if (p / "__init__.py").exists()}
    assert subs == set(AGENT_LAYERS) - {"top"}, "add the new agents/ subpackage to AGENT_LAYERS"
    for sub in subs:
        doc = ast.get_docstring(ast.parse((ROOT / "agents" / sub / "__init__.py").read_text()))
        assert doc and "Imports:" in doc, f"agents/{sub}/__init__.py says what it may import"


def test_no_import_loops():
    loops = import_loops(import_graph(source_files(*PACKAGES)))
    assert not loops, "modules that import each other (move the shared piece down):\n" + (
        "\n".join(" <-> ".join(loop) for loop in loops)
    )


def test_no_upward_imports():
    offenders = upward_arrows(import_graph(source_files(*PACKAGES)))
    assert not offenders, "imports against the layers (LAYERS, AGENT_LAYERS):\n" + "\n".join(
        offenders
    )


def _tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return sorted(tmp_path.rglob("*.py"))


def test_the_checks_fail_on_a_loop_and_an_upward_import(tmp_path, monkeypatch):
    """The same checks on a made-up tree: each kind of offence is found, a clean one passes."""
    monkeypatch.setitem(globals(), "ROOT", tmp_path)  # module_name() reads ROOT
    files = _tree(
        tmp_path,
        {
            "branchgym/__init__.py": "from branchgym import core\n",
            "branchgym/core.py": "import branchgym\n",  # the root: no loop
            "branchgym/a.py": "def f():\n    from branchgym.b import g\n",
            "branchgym/b.py": "from branchgym import a\n",
            "agents/__init__.py": "",
            "agents/forward/__init__.py": "",
            "agents/forward/rows.py": "from branchgym.agents.learners.bpo import loss\n",
            "agents/learners/__init__.py": "",
            "agents/learners/bpo.py": "from agents.learners import grpo\n",
            "agents/learners/grpo.py": "from branchgym.agents.forward import rows\n",
            "wrappers/__init__.py": "",
            "wrappers/w.py": "from branchgym.envs import toy\n",
            "branchgym/envs/__init__.py": "",
            "branchgym/envs/toy.py": "from branchgym.core import x\n",
        },
    )
    graph = import_graph(files)
    loops = import_loops(graph)
    assert ["branchgym.a", "branchgym.b"] in loops
    assert not any("branchgym.core" in loop for loop in loops)
    up = "\n".join(upward_arrows(graph))
    assert "branchgym.agents.forward.rows:1 -> branchgym.agents.learners.bpo" in up
    assert "branchgym.wrappers.w:1 -> branchgym.envs.toy" in up
    assert "learners never import each other" in up
    assert "branchgym.envs.toy" not in up.split("->")[0]
    clean = _tree(tmp_path / "clean", {"branchgym/x.py": "from branchgym import y\n"})
    monkeypatch.setitem(globals(), "ROOT", tmp_path / "clean")
    assert not import_loops(import_graph(clean))
    assert not upward_arrows(import_graph(clean))
