"""The wrappers/, scenarios/ and agents/ folders install inside the branchgym namespace."""

import pathlib
import subprocess
import sys
import zipfile

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAPPED = {
    "wrappers": "branchgym.wrappers",
    "scenarios": "branchgym.scenarios",
    "agents": "branchgym.agents",
}


def declared_packages():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(cfg["packages"]), cfg["package-dir"]


def test_every_package_folder_is_declared():
    packages, package_dir = declared_packages()
    for folder, name in [("branchgym", "branchgym"), *MAPPED.items()]:
        assert package_dir[name] == folder
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            dotted = ".".join([name, *rel.parts])
            assert dotted in packages, f"{dotted} missing from [tool.setuptools] packages"


def test_shipped_data_is_one_folder_under_one_rule():
    """data/ holds every shipped repository and task source; each tool has one rule for it.

    The wheel maps it to ``branchgym/data/``, ruff skips it, and no folder of the import
    tree holds .py files that are not modules (a folder with .py files is a package).
    """
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    tops = sorted(p.name for p in (ROOT / "data").iterdir() if p.is_dir())
    assert tops and not [t for t in tops if t.isidentifier()], tops  # never importable
    assert cfg["setuptools"]["package-dir"]["branchgym.data"] == "data"
    assert "branchgym.data" in cfg["setuptools"]["packages"]
    assert sorted(cfg["setuptools"]["package-data"]["branchgym.data"]) == [
        f"{t}/**/*" for t in tops
    ]
    assert sorted(cfg["ruff"]["extend-exclude"]) == [".venv", "build", "data"]
    for folder in [*MAPPED, "branchgym"]:
        for path in (ROOT / folder).rglob("*.py"):
            assert (path.parent / "__init__.py").exists(), f"{path}: data belongs in data/"
    from branchgym.envs.swebench import generated

    assert generated.SHIPPED_DATA == ROOT / "data"  # a checkout (editable install) finds it
    assert (generated.DATA_DIR / "tasks.json").is_file()
    assert (generated.REALISTIC_DIR / "tasks.json").is_file()


def test_imports_from_repo_root():
    import branchgym.agents
    import branchgym.scenarios
    import branchgym.wrappers

    for mod, folder in [
        (branchgym.wrappers, "wrappers"),
        (branchgym.agents, "agents"),
        (branchgym.scenarios, "scenarios"),
    ]:
        assert pathlib.Path(mod.__file__).parent == ROOT / folder


@pytest.mark.slow
def test_built_wheel_installs_in_a_throwaway_venv(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("branchgym-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert not tops & {"wrappers", "scenarios", "agents", "tests"}, tops
    assert "branchgym/wrappers/__init__.py" in names and "branchgym/agents/__init__.py" in names
    data = "branchgym/data/swebench-generated/"
    assert data + "tasks.json" in names and data + "textstats/base/textstats/core.py" in names
    real = "branchgym/data/swebench-realistic/"
    assert real + "tasks.json" in names and real + "six/upstream/LICENSE" in names
    assert real + "cachetools/upstream/src/cachetools/__init__.py" in names
    assert {f"branchgym/view_assets/viewer.{x}" for x in ("html", "js", "css")} <= set(names)
    venv = tmp_path / "venv"
    # The dependencies come from this interpreter's site-packages; the wheel itself is
    # installed into the throwaway venv only, so the imports below can only succeed
    # through the wheel's own layout.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    deps = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gymnasium, os; print(os.path.dirname(os.path.dirname(gymnasium.__file__)))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (pathlib.Path(site) / "deps.pth").write_text(deps + "\n")
    code = (
        "import branchgym.wrappers, branchgym.scenarios, branchgym.agents, branchgym;"
        "import gymnasium as gym;"
        f"assert branchgym.wrappers.__file__.startswith({site!r}), branchgym.wrappers.__file__;"
        "env = gym.make('branchgym/TreeMDP-v0'); env.reset(seed=0);"
        "env.snapshot().release(); print('ok')"
    )
    out = subprocess.run([py, "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
