"""``branchgym bench``: one study per module, each writing a markdown report and PNG plots.

A study module has ``configure(parser)`` (its options) and ``main(args) -> exit code``.
:data:`STUDIES` maps the study name to its module; studies load lazily, so one study's
optional dependencies never slow down or break another.
"""

from __future__ import annotations

#: study name -> (module, one-line description)
STUDIES: dict[str, tuple[str, str]] = {
    "snapshot": ("branchgym.bench.snapshot", "snapshot/restore cost and bytes per env, vs replay"),
    "theory": ("branchgym.bench.theory", "branching theory on TreeMDP: exact vs measured"),
    "webshop": (
        "branchgym.bench.webshop",
        "WebShop's scripted expert: reward on a goal split",
    ),
    "fidelity": ("branchgym.bench.fidelity", "FidelityCheck overhead per env and mode"),
    "erosion": (
        "branchgym.bench.erosion",
        "bias of sibling advantages (eq. 4) under injected nondeterminism",
    ),
    "variance": (
        "branchgym.bench.variance",
        "the source's diagnostic: independent vs within-snapshot return variance, per env",
    ),
    "engine": ("branchgym.bench.engine", "sibling generation with and without prefix KV reuse"),
    "packing": (
        "branchgym.bench.packing",
        "learner forward + backward: packed tree (4-D mask) vs plain causal rows",
    ),
    "branching": (
        "branchgym.bench.branching",
        "branching overhead and tokens saved by shared prefixes, per env",
    ),
    "learning": (
        "branchgym.bench.bpo_vs_grpo",
        "Branching PO vs GRPO vs RLOO at matched rollouts, ablations, WebShop after SFT",
    ),
    "distill": (
        "branchgym.bench.distill",
        "Branching OPD vs vanilla and multi-rollout OPD: success, reverse KL, tokens saved",
    ),
    "bellman": (
        "branchgym.bench.bellman",
        "Bellman PO vs GRPO with several updates per batch: success, omega vs ratio spread",
    ),
    "learners": (
        "branchgym.bench.all_learners",
        "the reference learners at matched compute on TextTreeMDP: exact success by step",
    ),
    "gradient-noise": (
        "branchgym.bench.gradient_noise",
        "each learner's gradient-estimator noise at a frozen policy: NSR, split-half cosine",
    ),
    "trl": (
        "branchgym.bench.trl_trainer",
        "branchgym grpo and bpo vs TRL's GRPOTrainer: step time, its split, learner tokens",
    ),
    "eval": (
        "branchgym.bench.eval_speed",
        "branchgym eval's lockstep batches vs a plain one-episode loop: episodes per hour",
    ),
    "linear": (
        "branchgym.bench.linear",
        "a float32 linear layer on MKL (PyTorch's default) vs oneDNN (HFEngine's), per shape",
    ),
    "eval-states": (
        "branchgym.bench.eval_states",
        "two agents compared from identical snapshots vs independent runs: interval widths",
    ),
    "estimator": (
        "branchgym.bench.estimator",
        "Branching PO and its variants as gradient estimators on TreeMDP vs the exact gradient",
    ),
}

__all__ = ["STUDIES"]
