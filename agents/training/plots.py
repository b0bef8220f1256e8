"""Training curves as PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["plot_curves"]


def plot_curves(history: Sequence[dict[str, float]], path: Path, *, title: str = "") -> None:
    """PNG of success, return, policy loss and gradient norm over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [
        ("charts/success", "eval/success"),
        ("charts/return", "eval/return"),
        ("losses/policy_loss", "losses/sft"),
        ("grad/norm", None),
    ]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3))
    for ax, (train_key, eval_key) in zip(axes, keys, strict=True):
        for key, style in ((train_key, "-"), (eval_key, "o--")):
            pts = [(h["step"], h[key]) for h in history if key and key in h]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, label=key)
        ax.set_xlabel("step")
        ax.set_title(train_key.split("/")[-1])
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
