"""``branchgym diagnose``: will branching pay on my task? One answer from two figures.

The first is the source's diagnostic before training
(:func:`branchgym.bench.variance.diagnose`: independent vs within-snapshot return variance
at the midpoint, the implied Var(A^BPO)/Var(A^GRPO)).

The midpoint ratio is about returns; it is not the noise of the gradient either learner
follows. ``branchgym diagnose`` therefore also reports an estimator-level figure
(:func:`branchgym.bench.gradient_noise.estimator_noise`): at the policy it diagnoses (the
tiny random Qwen2 standing in for ``random``), a few independent batches of RLOO and of
Branching PO, each learner's own surrogate policy gradient per batch, and the
noise-to-signal ratio tr Cov / |mean|^2 at matched tokens (``branchgym bench
gradient-noise`` measures the same with hundreds of batches). Its verdict is stated from
that figure.

The command sits above both studies (:mod:`branchgym.bench.variance`,
:mod:`branchgym.bench.gradient_noise`), which never import it.
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

from branchgym.bench.variance import diagnose

__all__ = ["configure_diagnose", "cmd_diagnose"]


def configure_diagnose(p: argparse.ArgumentParser) -> None:
    """Options of ``branchgym diagnose``."""
    from branchgym.bench.gradient_noise import NOISE_BATCHES, NOISE_PROMPTS

    p.add_argument("env_id", help="a registered env id")
    p.add_argument("--model", default="random", help="random, tiny, smollm2 or a model folder")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--independent", type=int, default=8)
    p.add_argument("--completions", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env-kwargs", default="{}", help="gym.make kwargs as JSON")
    p.add_argument(
        "--noise-batches",
        type=int,
        default=NOISE_BATCHES,
        help=f"batches per learner for the estimator-noise figure, BPO vs RLOO "
        f"({NOISE_BATCHES}; 0 skips it)",
    )
    p.add_argument(
        "--noise-prompts",
        type=int,
        default=NOISE_PROMPTS,
        help=f"prompts per batch for the estimator-noise figure ({NOISE_PROMPTS})",
    )


def cmd_diagnose(args: argparse.Namespace) -> int:
    """One-shot answer to "will branching pay on my task?"."""
    import json

    from branchgym.registration import branch_spec

    try:
        kwargs = json.loads(args.env_kwargs)
    except json.JSONDecodeError as exc:
        print(f"branchgym diagnose: --env-kwargs is not JSON ({exc}); e.g. '{{\"depth\": 4}}'")
        return 2
    spec = branch_spec(args.env_id)  # unknown ids raise UnknownEnvError with a suggestion
    if spec.missing():
        print(
            f"branchgym diagnose: {args.env_id} needs "
            f"pip install 'branchgym[{','.join(spec.missing())}]'"
        )
        return 2
    total = args.prompts * args.independent
    with tqdm(total=total, desc=f"diagnose {args.env_id}") as bar:
        d = diagnose(
            args.env_id,
            kwargs,
            policy=args.model,
            prompts=args.prompts,
            independent=args.independent,
            completions=args.completions,
            seed=args.seed,
            progress=bar.update,
        )
    print(
        f"{d.env_id} with {d.policy}: {d.prompts} prompts x {args.independent} trajectories, "
        f"{args.completions} completions per midpoint snapshot"
    )
    print(f"  mean return {d.mean_return:.3f}, mean length {d.mean_length:.1f} decisions")
    print(f"  variance of independent returns     {d.var_independent:.4f}")
    print(f"  mean variance within a snapshot     {d.var_within:.4f}")
    exact = "" if d.exact_ratio is None else f" (exact {d.exact_ratio:.3f})"
    print(f"  implied Var(A^BPO)/Var(A^GRPO)      {d.ratio:.3f} ± {d.ratio_se:.3f}{exact}")
    print(f"=> {d.verdict}")
    if args.noise_batches < 2:
        return 0
    from branchgym.bench.gradient_noise import estimator_noise

    n = estimator_noise(
        args.env_id,
        kwargs,
        model=args.model,
        batches=args.noise_batches,
        prompts=args.noise_prompts,
        seed=args.seed,
    )
    stand_in = " standing in for a policy without gradients" if n.model != args.model else ""
    print(
        f"estimator level ({n.model}{stand_in}, frozen; {n.batches} batches of {n.prompts} "
        "prompts per learner, N = 7 rollouts per prompt; the midpoint ratio above is about "
        "returns, this about gradients):"
    )
    for label, s in n.results.items():
        print(
            f"  {label:4s} NSR tr Cov/|mean|^2 {s['nsr']:.3f} (halves {s['nsr_a']:.2f} / "
            f"{s['nsr_b']:.2f}), {s['tokens_per_batch']:.0f} tokens/batch, matched tokens "
            f"{s['nsr_tokens']:.3f}"
        )
    if not n.error:
        a, b = n.half_ratios()
        print(
            f"  noise-to-signal at matched tokens, BPO/RLOO  {n.ratio:.3f} "
            f"(halves {a:.2f} / {b:.2f})"
        )
    print(f"=> estimator: {n.verdict}")
    return 0
