"""``branchgym view``: trees saved by a real training run, rendered in headless Chromium.

The browser is the distribution's ``chromium`` (``make test`` installs it) driven by
playwright; no browser is downloaded. Every check reads the page's DOM after its
scripts ran.
"""

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import branchgym
from branchgym.cli import main as cli_main
from branchgym.envs.toy.text_tree_mdp import TextTreeMDP
from branchgym.registration import unregister
from branchgym.rollout.tree import RolloutTree
from branchgym.tree_format import read_tree_file, save_trees
from branchgym.viewer import render_html, write_view

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = os.environ.get("BRANCHGYM_CHROMIUM") or shutil.which("chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ENV_ID = "test/RestoreFailsOnce-v0"
ENV_KWARGS = {"depth": 5, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}
#: Set to a path (docs/img/tree_viewer.png) to refresh the screenshot the docs show.
DOCS_SHOT = os.environ.get("BRANCHGYM_VIEWER_SCREENSHOT")


class RestoreFailsOnce(TextTreeMDP):
    """A maze whose second restore fails, as a sandbox whose overlay vanished would."""

    restores = 0

    def _set_state(self, state):
        RestoreFailsOnce.restores += 1
        if RestoreFailsOnce.restores == 2:
            raise RuntimeError("restore failed: the overlay upper dir is gone")
        return super()._set_state(state)


@pytest.fixture(scope="module", autouse=True)
def restore_fails_env():
    # Registered while this module runs only: studies that walk every registered env
    # (bench snapshot) must not meet an env whose restores fail on purpose.
    branchgym.register(ENV_ID, RestoreFailsOnce, max_episode_steps=8)
    yield
    unregister(ENV_ID)


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM:
        pytest.skip("Debian's chromium is not installed (make test installs it)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(browser, html: Path, width=1500, height=900):
    page = browser.new_page(viewport={"width": width, "height": height})
    problems, requests = [], []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("request", lambda r: requests.append(r.url))
    t0 = time.perf_counter()
    page.goto(html.resolve().as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    page.load_s = time.perf_counter() - t0
    page.problems, page.requests = problems, requests
    return page


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("viewer") / "bpo-run"
    RestoreFailsOnce.restores = 0
    code = cli_main(
        [
            "train", "--algo", "bpo", "--env", ENV_ID, "--env-kwargs", json.dumps(ENV_KWARGS),
            "--model", "tiny", "--steps", "2", "--prompts", "2", "--out", str(out),
            "--no-progress", "--set", "m=2", "k=4", "gap_unit=steps", "threads=1", "lr=1e-3",
            "save_trees_every=1",
        ]
    )  # fmt: skip
    assert code == 0
    return out


@pytest.mark.slow
def test_training_saves_each_steps_trees_with_the_advantages_it_used(run_dir):
    from branchgym.agents.estimators import advantages
    from branchgym.agents.learners import bpo

    files = sorted(p.name for p in (run_dir / "trees").iterdir())
    assert files == ["step_000001.json.gz", "step_000002.json.gz"]
    tf = read_tree_file(run_dir / "trees" / files[0])
    assert tf.meta["step"] == 1 and tf.meta["algo"] == "bpo" and tf.meta["env_id"] == ENV_ID
    assert len(tf.trees) == 2
    errors = [n for t in tf.trees for n in t if n.error]
    assert len(errors) == 1 and "restore failed: the overlay upper dir is gone" in errors[0].error
    args = bpo.Args()
    for tree in tf.trees:
        assert [b.k for b in tree.branch_points()] == [4, 4]
        saved = tree.meta["advantages"]
        # the learner's own eq. 4-5 advantages, for every decision whose tokens the loss saw
        again, _, _ = advantages.tree_advantages(tree, args.lam, args.tail)
        assert saved == {i: again[i] for i in saved}
        assert set(saved) == {n.id for n in tree if n.n_tokens}
        assert not any(n.id in saved for n in tree if n.error)


@pytest.mark.slow
def test_a_run_started_over_in_the_same_folder_drops_the_old_runs_trees(run_dir, tmp_path):
    again = tmp_path / "again"
    shutil.copytree(run_dir, again)
    code = cli_main(
        [
            "train", "--algo", "bpo", "--env", "branchgym/TextTreeMDP-v0", "--model", "tiny",
            "--steps", "1", "--prompts", "1", "--out", str(again), "--no-progress", "--set",
            "m=1", "k=2", "gap_unit=steps", "threads=1", "save_trees_every=1", "overwrite=true",
        ]
    )  # fmt: skip
    assert code == 0
    assert sorted(p.name for p in (again / "trees").iterdir()) == ["step_000001.json.gz"]
    (tree,) = read_tree_file(again / "trees" / "step_000001.json.gz").trees
    assert tree.env_id == "branchgym/TextTreeMDP-v0"


@pytest.mark.slow
def test_view_of_a_training_run_in_headless_chromium(run_dir, browser, tmp_path, capsys):
    html = tmp_path / "view.html"
    assert cli_main(["view", str(run_dir), "--out", str(html), "--no-open"]) == 0
    assert capsys.readouterr().out.strip() == str(html)
    tf = read_tree_file(run_dir / "trees" / "step_000001.json.gz")
    ti = next(i for i, t in enumerate(tf.trees) if any(n.error for n in t))
    tree = tf.trees[ti]

    page = open_page(browser, html)
    assert page.locator("#step-select option").all_inner_texts() == ["step 1", "step 2"]
    page.select_option("#step-select", "0")
    page.select_option("#tree-select", str(ti))
    page.wait_for_function(f"document.body.dataset.nodes === '{len(tree)}'")

    ids = [int(x) for x in page.eval_on_selector_all("[data-node-id]",
           "els => els.map(e => e.dataset.nodeId)")]  # fmt: skip
    assert sorted(ids) == list(range(len(tree)))
    backbone = page.eval_on_selector_all(
        "[data-backbone='1']", "els => els.map(e => Number(e.dataset.nodeId))"
    )
    assert backbone == tree.backbone
    assert page.locator("path.edge.backbone").count() == len(tree.backbone)
    ks = page.eval_on_selector_all("[data-bp-k]", "els => els.map(e => Number(e.dataset.bpK))")
    assert ks == [b.k for b in tree.branch_points()] == [4, 4]
    # the branch point with the failed sibling: K, and the sibling returns that fit
    bps = tree.branch_points()
    bi = next(i for i, b in enumerate(bps) if any(tree[x].error for x in b.siblings))
    badge = page.locator(f"[data-bp='{bi}'] text").text_content()
    shown = badge.removeprefix("K=4  G ").removesuffix(" …").split(" · ")
    expect = [
        f"{r:.2f}".rstrip("0").rstrip(".") if tree.line_valid(x) else "✕"
        for r, x in zip(bps[bi].returns, bps[bi].siblings, strict=True)
    ]
    assert badge.startswith("K=4  G ") and shown == expect[: len(shown)], badge
    returns = page.eval_on_selector(f"[data-bp='{bi}']", "e => JSON.parse(e.dataset.bpReturns)")
    assert returns == list(bps[bi].returns)
    flags = page.eval_on_selector_all("[data-bp]", "els => els.map(e => e.dataset.bpDegenerate)")
    ran = [{r for r, x in zip(b.returns, b.siblings, strict=True) if tree.line_valid(x)}
           for b in bps]  # fmt: skip
    assert flags == ["1" if len(g) <= 1 else "0" for g in ran]

    (err,) = [n for n in tree if n.error]
    leaf = page.locator("[data-error]")
    assert leaf.count() == 1 and leaf.get_attribute("data-error") == err.error
    assert int(leaf.get_attribute("data-node-id")) == err.id
    assert leaf.locator("text").text_content().startswith("RuntimeError: restore failed")

    # the detail panel after a click on a sibling of the first branch point
    sib = next(s for s in tree.branch_points()[0].siblings[1:] if not tree[s].error)
    page.click(f"[data-node-id='{sib}'] circle")
    detail = page.locator("#detail")
    assert detail.get_attribute("data-node") == str(sib)
    assert detail.locator("[data-field='action']").inner_text() == tree[sib].text.strip()
    assert detail.locator("[data-field='observation']").inner_text() == tree[sib].observation
    adv = tree.meta["advantages"][sib]
    shown = detail.locator("[data-field='advantage']").inner_text()
    assert float(shown.replace("+", "")) == pytest.approx(adv, abs=5e-4)
    page.click(f"[data-node-id='{err.id}'] rect")
    assert detail.locator("[data-field='error']").inner_text() == err.error
    page.click(f"[data-bp='{bi}'] rect")
    rows = detail.locator("[data-field='siblings'] tr[data-sibling]")
    assert rows.count() == 4
    assert "error" in rows.nth(bps[bi].siblings.index(err.id)).inner_text()

    assert page.locator("#curves").is_visible()
    assert "charts/return" in page.eval_on_selector_all(
        "[data-curve]", "els => els.map(e => e.dataset.curve)"
    )
    # nothing but the page itself was loaded, and its scripts raised nothing
    assert page.problems == [] and all(u.startswith("file:") for u in page.requests)
    page.click(f"[data-node-id='{sib}'] circle")
    page.screenshot(path=str(tmp_path / "viewer.png"))
    assert (tmp_path / "viewer.png").stat().st_size > 10_000
    if DOCS_SHOT:
        shutil.copy(tmp_path / "viewer.png", DOCS_SHOT)
    page.close()


def large_tree(n_nodes=500, obs_bytes=2_100, seed=0):
    """A deep tree with ``n_nodes`` decisions and SWE-bench-sized observations."""
    rng = np.random.default_rng(seed)
    tree = RolloutTree("test/Large-v0", 3, "reset " + "x" * obs_bytes)
    words = np.array(["diff", "--git", "a/src/module.py", "+", "-", "def", "return", "pass"])

    def decision(parent, size=None, **kw):
        k = int(rng.integers(8, 40))
        size = size or int(rng.integers(obs_bytes // 3, 5 * obs_bytes // 3))
        obs = " ".join(rng.choice(words, size // 4))[:size]
        return tree.add(
            parent,
            text=f"run: pytest -x tests/test_{len(tree)}.py",
            token_ids=rng.integers(0, 1000, k),
            logprobs=-rng.random(k),
            entropies=rng.random(k) * 2,
            observation=obs,
            reward=float(rng.random() < 0.3),
            parse_error="no Action: line in the reply" if len(tree) % 50 == 7 else None,
            **kw,
        )

    line = [decision(-1, 4_000)]
    while len(line) < 40:  # a 40-step backbone with 4 KB outputs
        line.append(decision(line[-1].id, 4_000, terminated=len(line) == 39))
    open_ = [n.id for n in line[:-1]]
    while len(tree) < n_nodes:
        parent = int(rng.choice(open_))
        node = decision(parent, terminated=bool(rng.random() < 0.12) or len(tree) == n_nodes - 1)
        if not node.done:
            open_.append(node.id)
    for parent in rng.choice(open_, 5, replace=False):  # lines a tree timeout cut
        tree.add(int(parent), truncated=True, error="not run: tree timeout: past its 3600 s")
    tree.meta["advantages"] = {n.id: float(rng.normal()) for n in tree}
    return tree


def test_view_of_a_500_node_tree_with_1_mb_of_observations(browser, tmp_path, capsys):
    tree = large_tree()
    assert len(tree) >= 500
    obs_chars = sum(len(n.observation or "") for n in tree)
    assert obs_chars >= 1_000_000
    path = save_trees(tmp_path / "large.json.gz", [tree], step=7)
    t0 = time.perf_counter()
    out = write_view(path)
    write_s = time.perf_counter() - t0
    assert out == tmp_path / "large.html"
    page = open_page(browser, out)
    render_ms = float(page.evaluate("document.body.dataset.renderMs"))
    paint_ms = float(page.evaluate("document.body.dataset.paintMs"))
    assert page.locator("[data-node-id]").count() == len(tree)
    assert page.locator("[data-bp-k]").count() == len(tree.branch_points())
    assert page.locator("[data-invalid]").count() == sum(1 for n in tree if n.parse_error) > 0
    # a long observation is cut for display and expands on request
    deep = tree.backbone[20]  # off screen: walk there with the keyboard
    page.click(f"[data-node-id='{tree.backbone[0]}'] circle")
    for _ in range(20):
        page.keyboard.press("ArrowRight")
    assert page.get_attribute("#detail", "data-node") == str(deep)
    page.click(f"[data-node-id='{deep}'] circle")  # the panel followed it on screen
    obs = page.locator("#detail [data-field='observation']")
    assert obs.get_attribute("data-truncated") == "1" and len(obs.inner_text()) < 3100
    page.click("#detail [data-expand='observation']")
    assert obs.inner_text() == tree[deep].observation
    # zooming out hides the action labels, not the error and branch labels
    for _ in range(6):
        page.click("#zoom-out")
    assert "far" in (page.get_attribute("svg#tree", "class") or "")
    assert page.problems == []
    page.screenshot(path=str(tmp_path / "large.png"))
    with capsys.disabled():
        print(
            f"\nviewer, {len(tree)} decisions, {obs_chars / 1e6:.2f} MB of observations: "
            f"page {out.stat().st_size / 1e6:.2f} MB written in {write_s:.2f} s; in Chromium "
            f"render {render_ms:.0f} ms, first paint {paint_ms:.0f} ms, load to ready "
            f"{page.load_s:.2f} s"
        )
    page.close()


def test_view_refuses_what_is_not_a_tree_file_or_a_run(tmp_path, capsys):
    assert cli_main(["view", str(tmp_path / "nothing"), "--no-open"]) == 1
    assert "does not exist; give a tree file" in capsys.readouterr().err
    assert cli_main(["view", str(tmp_path), "--no-open"]) == 1
    assert "save_trees_every=N" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "branchgym.trees", "version": 9}')
    assert cli_main(["view", str(bad), "--no-open"]) == 1
    assert "version 9" in capsys.readouterr().err


def test_page_is_self_contained_and_escapes_what_the_trees_hold(tmp_path):
    tree = RolloutTree("test/Html-v0", 0, "</script><script>alert(1)</script>")
    tree.add(-1, text="<b>bold</b>", observation="</script>", terminated=True)
    html = render_html(save_trees(tmp_path / "t.json", [tree]))
    assert "<script src" not in html and "<link" not in html and "@import" not in html
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//|url\(", html)
    assert html.count("</script>") == html.count("<script")  # no script closed by data


def test_view_opens_a_browser_only_where_one_can_show_it(tmp_path, monkeypatch, capsys):
    import webbrowser

    opened = []

    class Fake:
        def open(self, url):
            opened.append(url)
            return True

    monkeypatch.setattr(webbrowser, "get", lambda *a: Fake())
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("BROWSER", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.delenv("DISPLAY", raising=False)
    path = save_trees(tmp_path / "t.json.gz", [RolloutTree("test/T-v0", 0, "obs")])
    assert cli_main(["view", str(path)]) == 0  # no display: say where the page is
    assert opened == [] and "no browser to open here" in capsys.readouterr().err
    monkeypatch.setenv("DISPLAY", ":0")
    assert cli_main(["view", str(path)]) == 0
    assert opened == [(tmp_path / "t.html").resolve().as_uri()]
    assert cli_main(["view", str(path), "--no-open"]) == 0 and len(opened) == 1
