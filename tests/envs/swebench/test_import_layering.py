"""No module of branchgym.envs.swebench imports one that imports it back.

Every import counts: at module level, inside functions (deferred imports) and under
``TYPE_CHECKING``. A loop means two modules cannot be read, tested or replaced on their
own; the shared piece belongs in a lower module both import.
"""

import ast
from pathlib import Path

import branchgym.envs.swebench as pkg

PACKAGE = "branchgym.envs.swebench"
FOLDER = Path(pkg.__file__).parent


def _imports(path: Path) -> set[str]:
    """The modules of the package that ``path`` imports, anywhere in its code."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith(PACKAGE + "."):
                mod = name[len(PACKAGE) + 1 :].split(".")[0]
                if (FOLDER / f"{mod}.py").exists():
                    out.add(mod)
    return out


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p) - {p.stem} for p in FOLDER.glob("*.py") if p.stem != "__init__"}


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(graph.get(mod, ()))
    return seen


def test_the_graph_is_read():
    graph = _graph()
    assert "git_sandbox" in graph["local"] and "layers" in graph["git_sandbox"]
    assert "docker_backend" in graph["env"]  # a deferred import counts


def test_no_module_imports_one_that_imports_it_back():
    graph = _graph()
    loops = sorted(m for m in graph if m in _reach(graph, m))
    detail = {m: sorted(d for d in graph[m] if m in _reach(graph, d) or d == m) for m in loops}
    assert not loops, f"import loops in {PACKAGE} (module -> what leads back): {detail}"
