"""``branchgym view``: a rollout tree, or a training run's trees, as one HTML file.

The page is self-contained: the trees, the run's metrics, the script and the styles are
all inline (no server, no network, no CDN), so it opens from disk, from a CI artefact or
an e-mail. It lays a tree out by depth with the backbone on top, colours each decision
by the advantage the learner gave it, marks each branch point with its K and its
siblings' returns, shows every error leaf with its reason, and opens a decision's
action, observation and figures on click (docs/engine.md, "Tree files").

What the page shows is computed here, from :class:`~branchgym.rollout.tree.RolloutTree`
itself (backbone, branch points, returns-to-go, which lines are valid), so the viewer
agrees with the learners by construction; the script only lays out and draws.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from branchgym.error import TreeFormatError
from branchgym.rollout.tree import RolloutTree
from branchgym.tree_format import read_tree_file

__all__ = ["configure", "render_html", "run", "tree_view", "write_view"]

#: Per-token entropies kept per node for the detail panel's sparkline.
MAX_TOKEN_ENTROPIES = 512
#: Metric keys drawn first in a run's learning curves (others are one click away).
DEFAULT_CURVES = (
    "charts/return",
    "charts/success",
    "eval/success",
    "losses/policy_loss",
    "advantages/std",
    "grad/norm",
)


def _num(x: Any) -> float | None:
    """A finite float, or None (strict JSON has no NaN; the page shows "-")."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _text(x: Any) -> str:
    return x if isinstance(x, str) else ("" if x is None else repr(x))


def tree_view(tree: RolloutTree) -> dict[str, Any]:
    """What the page draws for one tree (plain JSON data)."""
    adv = tree.meta.get("advantages") or {}
    rtg = tree.returns_to_go()
    backbone = set(tree.backbone)
    leaves = set(tree.leaves())
    nodes = []
    for n in tree.nodes:
        ent = n.entropies
        nodes.append(
            {
                "id": n.id,
                "parent": n.parent,
                "step": n.step,
                "k": tree.sibling_index(n.id),
                "rollout": n.rollout,
                "action": n.text.strip() or _text(n.action),
                "observation": _text(n.observation),
                "reward": _num(n.reward),
                "return": _num(rtg[n.id]),
                "advantage": _num(adv[n.id]) if n.id in adv else None,
                "tokens": n.n_tokens,
                "generated": n.n_generated,
                "entropy": _num(ent.mean()) if ent.size else None,
                "entropy_max": _num(ent.max()) if ent.size else None,
                "logprob": _num(n.logprobs.sum()) if n.logprobs.size else None,
                "entropies": [round(float(e), 4) for e in ent[:MAX_TOKEN_ENTROPIES]],
                "done": "terminated" if n.terminated else ("truncated" if n.truncated else ""),
                "error": n.error,
                "parse_error": n.parse_error,
                "invalid": bool(n.parse_error) or n.info.get("invalid_action") is True,
                "costs": {k: _num(v) for k, v in n.costs.items()},
                "info": json.dumps(n.info, default=repr)[:4000] if n.info else "",
                "backbone": n.id in backbone,
                "leaf": n.id in leaves,
            }
        )
    scores = {f.get("step"): f.get("score") for f in tree.meta.get("forks", []) or []}
    branch_points = []
    for b in tree.branch_points():
        on_backbone = b.siblings[0] in backbone
        valid = [tree.line_valid(s) for s in b.siblings]
        compared = {r for r, ok in zip(b.returns, valid, strict=True) if ok}
        branch_points.append(
            {
                "parent": b.parent,
                "step": b.step,
                "k": b.k,
                "token_offset": b.token_offset,
                "siblings": list(b.siblings),
                "returns": [_num(r) for r in b.returns],
                "valid": valid,
                # every sibling that ran returned the same: no learning signal here
                "degenerate": len(compared) <= 1,
                "score": _num(scores.get(b.step)) if on_backbone else None,
            }
        )
    returns = tree.returns()
    s = tree.stats
    return {
        "env_id": tree.env_id,
        "seed": tree.seed,
        "observation": _text(tree.observation),
        "nodes": nodes,
        "backbone": tree.backbone,
        "branch_points": branch_points,
        "rollouts": len(leaves),
        "mean_return": _num(returns.mean()) if returns.size else None,
        "errors": sum(1 for n in tree.nodes if n.error),
        "stats": {
            "env steps": s.env_steps,
            "generated tokens": s.generated_tokens,
            "tokens saved": _num(s.tokens_saved),
            "snapshot ms": _num(s.snapshot_s * 1e3),
            "restore ms": _num(s.restore_s * 1e3),
            "branching overhead": _num(s.branching_overhead),
            "snapshots taken": s.snapshots_taken,
            "wall s": _num(s.wall_s),
        },
        # branchgym eval attribute's trees: V(s_t) along the episode and the decisive step
        "attribution": _attribution(tree.meta.get("attribution")),
    }


def _attribution(meta: Any) -> dict[str, Any] | None:
    if not isinstance(meta, dict):
        return None
    values = [
        [int(v[0]), _num(v[1]), _num(v[2]), _num(v[3]), int(v[4])]
        for v in meta.get("values", [])
        if isinstance(v, list | tuple) and len(v) == 5
    ]
    decisive = meta.get("decisive")
    return {
        "values": values,
        "decisive": int(decisive) if isinstance(decisive, int) else None,
        "statement": _text(meta.get("statement")),
    }


def _step_of(path: Path) -> int | None:
    m = re.search(r"step_(\d+)", path.name)
    return int(m.group(1)) if m else None


def _metrics(path: Path) -> list[dict[str, Any]]:
    out = []
    for raw in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):
            line = json.loads(raw)
            if isinstance(line, dict) and "step" in line:
                out.append({k: _num(v) for k, v in line.items()})
    return out


def _tree_files(folder: Path) -> list[Path]:
    files = [p for p in (folder / "trees").glob("step_*.json*") if p.is_file()]
    return sorted(files, key=lambda p: (_step_of(p) or 0, p.name))


def collect(path: str | Path) -> dict[str, Any]:
    """The page's data for a tree file or a run folder.

    Raises:
        TreeFormatError: ``path`` is neither a tree file nor a run folder with saved
            trees, or a tree file in it is malformed.
    """
    path = Path(path)
    if path.is_dir():
        files = _tree_files(path)
        if not files:
            raise TreeFormatError(
                f"{path} holds no saved trees (trees/step_*.json.gz); train with "
                "--set save_trees_every=N, or give the path of a tree file."
            )
        title = path.resolve().name
        metrics = _metrics(path / "metrics.jsonl")
    elif path.is_file():
        files, title, metrics = [path], path.name, []
    else:
        raise TreeFormatError(
            f"{path} does not exist; give a tree file (.json or .json.gz written by "
            "save_trees) or a run folder (the --out of branchgym train)."
        )
    steps = []
    for f in files:
        tf = read_tree_file(f)
        step = tf.meta.get("step", _step_of(f))
        steps.append(
            {
                "label": f"step {step}" if step is not None else f.name,
                "step": step if isinstance(step, int) else None,
                "file": f.name,
                "meta": {k: v for k, v in tf.meta.items() if isinstance(v, str | int | float)},
                "trees": [tree_view(t) for t in tf.trees],
            }
        )
    keys = sorted({k for line in metrics for k in line if k != "step"})
    return {"title": title, "steps": steps, "metrics": metrics, "metric_keys": keys,
            "default_curves": [k for k in DEFAULT_CURVES if k in keys]}  # fmt: skip


def _script_json(data: Any) -> str:
    """JSON safe inside ``<script type="application/json">`` (no ``</script>`` in it)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _asset(name: str) -> str:
    return resources.files("branchgym").joinpath("view_assets", name).read_text(encoding="utf-8")


def render_html(path: str | Path) -> str:
    """The self-contained page for a tree file or a run folder."""
    data = collect(path)
    steps = data.pop("steps")
    # one script element per step, parsed only when that step is shown
    blobs = "\n".join(
        f'<script type="application/json" id="bg-step-{i}">{_script_json(s)}</script>'
        for i, s in enumerate(steps)
    )
    data["step_labels"] = [s["label"] for s in steps]
    data["step_numbers"] = [s["step"] for s in steps]

    def escape(text: str) -> str:
        return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    return _asset("viewer.html").format_map(
        {
            "title": escape(f"branchgym view: {data['title']}"),
            "name": escape(data["title"]),
            "style": _asset("viewer.css"),
            "index": _script_json(data),
            "steps": blobs,
            "script": _asset("viewer.js"),
        }
    )


def write_view(path: str | Path, out: str | Path | None = None) -> Path:
    """Write the page for ``path``: by default ``view.html`` in a run folder, else beside it."""
    path = Path(path)
    if out is None:
        name = re.sub(r"(\.json)?(\.gz)?$", "", path.name) + ".html"
        out = path / "view.html" if path.is_dir() else path.with_name(name)
    out = Path(out)
    html = render_html(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out


def configure(p: argparse.ArgumentParser) -> None:
    """Options of ``branchgym view``."""
    p.add_argument("path", help="a tree file (trees/step_NNNNNN.json.gz) or a run folder")
    p.add_argument("--out", default=None, help="the HTML file (default: beside PATH)")
    p.add_argument("--no-open", action="store_true", help="write the file, open no browser")


def _graphical() -> bool:
    """Whether a browser window can open here (not a text browser taking the terminal)."""
    if os.environ.get("BROWSER") or sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def run(args: argparse.Namespace) -> int:
    """Write the page and open it in a browser where one is available."""
    import webbrowser

    out = write_view(args.path, args.out)
    print(out)
    if not args.no_open:
        opened = False
        if _graphical():
            try:
                opened = webbrowser.get().open(out.resolve().as_uri())
            except webbrowser.Error:
                opened = False
        if not opened:
            print(f"no browser to open here; open {out} in one", file=sys.stderr)
    return 0
