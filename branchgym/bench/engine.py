"""``branchgym bench engine``: sibling generation with and without prefix KV reuse.

At a branch point the K-1 siblings share their whole context. Without reuse each
sibling's request prefills that context again (what independent requests cost); with
reuse it is prefilled once and its KV cache repeated across the batch (HFEngine), or
its KV blocks are shared by vLLM's automatic prefix caching.

For each prefix length the study times one call that samples K-1 siblings of
``--new-tokens`` tokens each (stop tokens disabled, so every run generates the same
number of tokens), in three ways, interleaved in each repetition so machine noise
hits all of them alike:

* ``recompute``: no reuse, the prefix is prefilled once per sibling;
* ``reuse``: one prefill shared by the siblings (cold cache);
* ``cached``: the backbone already prefilled this state (the engine's prefix cache
  holds it), so the siblings start decoding at once.

The target of issue #7: at a 1,000-token prefix on this CPU, ``reuse`` at least 1.5x
faster than ``recompute``. vLLM (prefix caching on vs off) runs in ``.venv-vllm``.

Batched rollouts (issue 17, section ``rollouts``): the same P trees (BPO topology, M
branch points of K siblings, an ``LLMPolicy`` on the HF engine) grown two ways:

* ``serial``: today's loop, trees one after another and the engine decoding one prompt
  at a time (``HFEngine(batch_prompts=False)``);
* ``batched``: every tree in lockstep (:func:`branchgym.rollout.batch.grow_trees_batched`),
  one engine call per turn decoding all prompts in one left-padded batch, the envs of a
  turn stepped in one executor call.

It prints generated tokens/s and env steps/s of both and the speed-up, and checks that
both grew the same trees (same tokens).

The engine's overhead (issue 29, section ``overhead``): P prompts x n samples of exactly
``--new-tokens`` tokens (stops disabled) decoded by ``HFEngine.generate`` (its batched
prefix-reuse path, and with reuse off) against ``model.generate`` (sampling, temperature
1, no top-k/top-p, ``min_new_tokens`` = ``max_new_tokens``) on the same rows, each timed
at 1 new token (the prefill) and at ``--new-tokens``, interleaved in each repetition: the
difference per step is the cost of one decoding step of all rows, where the engine's own
per-token work (log-probs, entropies, per-row stop bookkeeping, Python) would show.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import tempfile
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from branchgym.bench.common import Report, Timing

__all__ = ["configure", "main", "SECTIONS"]

#: The study's sections (``--sections``).
SECTIONS = ("prefix", "rollouts", "overhead")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument(
        "--model",
        default="auto",
        help="smollm2, tiny, or a model folder (default: smollm2 when its wheel is "
        "installed, else tiny)",
    )
    parser.add_argument("--prefix", type=int, nargs="*", default=None, help="prefix lengths")
    parser.add_argument("--siblings", type=int, default=3, help="K-1 (default 3: K = 4)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared 2-core machine more threads are "
        "several times slower)",
    )
    parser.add_argument(
        "--vllm",
        choices=("auto", "on", "off"),
        default="auto",
        help="also measure vLLM in .venv-vllm (auto: when it exists)",
    )
    parser.add_argument("--quick", action="store_true", help="one prefix length, 1 repeat")
    parser.add_argument(
        "--sections",
        nargs="*",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="prefix (sibling generation at a shared prefix), rollouts (batched vs "
        "serial trees), overhead (the engine against model.generate); default all",
    )
    parser.add_argument(
        "--overhead-prompts", type=int, default=8, help="prompts P of the overhead section (8)"
    )
    parser.add_argument(
        "--overhead-samples", type=int, default=4, help="samples per prompt there (4)"
    )
    parser.add_argument(
        "--overhead-prompt-tokens",
        type=int,
        default=120,
        help="longest prompt there, in tokens (120; the others are 50-100 %% of it)",
    )
    parser.add_argument(
        "--rollout-model", default="tiny", help="model of the rollouts section (default tiny)"
    )
    parser.add_argument("--rollout-prompts", type=int, default=8, help="trees P (default 8)")
    parser.add_argument("--rollout-m", type=int, default=2, help="branch points M (default 2)")
    parser.add_argument("--rollout-k", type=int, default=4, help="siblings K (default 4)")
    parser.add_argument(
        "--rollout-new-tokens", type=int, default=16, help="tokens per action (default 16)"
    )
    parser.add_argument(
        "--rollout-steps", type=int, default=4, help="decisions per rollout at most (default 4)"
    )
    parser.add_argument(
        "--rollout-executor",
        default="inprocess",
        help="executor of the rollouts section: inprocess, thread, process (default inprocess)",
    )


def _model(name: str) -> tuple[Any, Any, str]:
    from branchgym.agents.policies.models import load_model, smollm2_gguf

    if name == "auto":
        try:
            smollm2_gguf()
            name = "smollm2"
        except Exception:
            name = "tiny"
    model, tok = load_model(name)
    return model, tok, name


def _hf_rows(args: argparse.Namespace, report: Report) -> tuple[list, dict, Any, Any, str]:
    import torch

    from branchgym.agents.engines.hf import HFEngine

    model, tok, name = _model(args.model)
    eng = HFEngine(
        model, tok, max_new_tokens=args.new_tokens, stop_token_ids=[], threads=args.threads
    )
    rng = np.random.default_rng(0)
    vocab = len(tok)
    eng.generate([[11] * 16], 2, max_new_tokens=2, seed=0, reuse_prefix=False)  # warm-up
    rows, data = [], {}
    k, new = args.siblings, args.new_tokens
    for plen in tqdm(args.prefix, desc=f"engine bench: HF {name}"):
        times: dict[str, list[float]] = {"recompute": [], "reuse": [], "cached": []}
        for rep in range(args.repeats):
            prompt = rng.integers(10, vocab - 10, size=plen).tolist()
            # rotate the order each repetition so load spikes do not favour one method
            order = ["recompute", "reuse", "cached"]
            order = order[rep % 3 :] + order[: rep % 3]
            eng.clear_cache()
            for method in order:
                if method == "cached":  # the backbone prefilled this state earlier
                    eng.generate([prompt], 1, max_new_tokens=1, seed=rep, reuse_prefix=True)
                elif method == "reuse":
                    eng.clear_cache()
                t0 = time.perf_counter()
                eng.generate([prompt], k, seed=rep, reuse_prefix=method != "recompute")
                times[method].append(time.perf_counter() - t0)
                eng.clear_cache()
        tm = {m: Timing.of(v) for m, v in times.items()}
        speed = tm["recompute"].median_ms / tm["reuse"].median_ms
        cached = tm["recompute"].median_ms / tm["cached"].median_ms
        data[plen] = {m: t.__dict__ for m, t in tm.items()}
        data[plen].update(speedup_reuse=speed, speedup_cached=cached)
        tps = lambda t: k * new / (t.median_ms / 1000)  # noqa: E731
        rows.append(
            [
                f"HF {name}",
                plen,
                f"{tm['recompute'].median_ms:.0f}",
                f"{tm['reuse'].median_ms:.0f}",
                f"{tm['cached'].median_ms:.0f}",
                f"{tps(tm['recompute']):.1f} / {tps(tm['reuse']):.1f}",
                f"{speed:.2f}x",
                f"{cached:.2f}x",
            ]
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report.data["hf"] = {"model": name, "device": device, "by_prefix": data}
    return rows, data, model, tok, name


def _vllm_rows(args: argparse.Namespace, model: Any, tok: Any, name: str) -> list:
    py = ROOT / ".venv-vllm" / "bin" / "python"
    if args.vllm == "off" or (args.vllm == "auto" and not py.exists()):
        return []
    if not py.exists():
        print("branchgym bench engine: .venv-vllm is missing (make vllm-venv)")
        return []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "model"
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": str(ROOT)}
        out = pathlib.Path(tmp) / "vllm.json"
        plens = ",".join(str(p) for p in args.prefix)
        cmd = [
            str(py),
            "-m",
            "branchgym.agents.engines.vllm",
            "bench",
            str(folder),
            str(out),
            plens,
            str(args.siblings),
            str(args.new_tokens),
        ]
        print("engine bench: vLLM in .venv-vllm (two engine starts, a few minutes) ...")
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env)
        if proc.returncode != 0:
            print(f"vLLM bench failed:\n{proc.stderr[-2000:]}")
            return []
        res = json.loads(out.read_text())
        for plen in args.prefix:
            on, off = res[str(plen)]["on"] * 1000, res[str(plen)]["off"] * 1000
            tps = lambda ms: args.siblings * args.new_tokens / (ms / 1000)  # noqa: E731
            rows.append(
                [
                    f"vLLM {name}",
                    plen,
                    f"{off:.0f}",
                    "",
                    f"{on:.0f}",
                    f"{tps(off):.1f} / {tps(on):.1f}",
                    "",
                    f"{off / on:.2f}x",
                ]
            )
    return rows


def _overhead_rows(args: argparse.Namespace, report: Report) -> None:
    """HFEngine's decoding against ``model.generate`` on the same batch."""
    import torch

    from branchgym.agents.engines.hf import HFEngine

    model, tok, name = _model(args.model)
    new = max(2, args.new_tokens)
    eng = HFEngine(model, tok, max_new_tokens=new, stop_token_ids=[], threads=args.threads)
    rng = np.random.default_rng(1)
    vocab = len(tok)
    top = max(2, args.overhead_prompt_tokens)
    lengths = [int(x) for x in rng.integers(top // 2, top + 1, size=args.overhead_prompts)]
    prompts = [rng.integers(10, vocab - 10, size=n).tolist() for n in lengths]
    n = args.overhead_samples
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    width = max(lengths)
    rows = [p for p in prompts for _ in range(n)]
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)

    def engine(reuse: bool):
        def run(rep: int, k: int) -> list[int]:
            out = eng.generate(
                prompts, n, seed=rep, reuse_prefix=reuse, batch_prompts=True, max_new_tokens=k
            )
            return [len(g.token_ids) for gs in out for g in gs]

        return run

    def plain(rep: int, k: int) -> list[int]:
        torch.manual_seed(rep)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=k,
                min_new_tokens=k,
                pad_token_id=pad,
            )
        return [out.shape[1] - width]

    methods = {
        "model.generate": plain,
        "engine, batched (prefix reuse)": engine(True),
        "engine, reuse off": engine(False),
    }
    for f in methods.values():  # warm-up
        f(0, 2)
    times: dict[tuple[str, int], list[float]] = {(m, k): [] for m in methods for k in (1, new)}
    order = list(methods)
    for rep in tqdm(range(args.repeats), desc=f"engine bench: overhead {name}"):
        for m in order[rep % 3 :] + order[: rep % 3]:
            for k in (1, new):
                eng.clear_cache()
                t0 = time.perf_counter()
                made = methods[m](rep, k)
                times[(m, k)].append(time.perf_counter() - t0)
                if set(made) != {k}:  # equal work, or the ratios mean nothing
                    raise RuntimeError(f"{m} generated {sorted(set(made))} tokens, not {k}")
    tm = {key: Timing.of(v) for key, v in times.items()}

    def decode(m: str) -> float:  # ms per decoding step of all rows
        return (tm[(m, new)].median_ms - tm[(m, 1)].median_ms) / (new - 1)

    base, base_step = tm[("model.generate", new)].median_ms, decode("model.generate")
    table = []
    for m in methods:
        t = tm[(m, new)]
        table.append(
            [
                m,
                f"{t.median_ms:.0f}",
                f"{len(rows) * new / (t.median_ms / 1000):.1f}",
                f"{t.median_ms / base:.2f}x",
                f"{tm[(m, 1)].median_ms:.0f}",
                f"{decode(m):.1f}",
                f"{decode(m) / base_step:.2f}x" if base_step > 0 else "n/a",
            ]
        )
    report.add(
        f"## The engine against model.generate\n\nHF {name}, {args.overhead_prompts} prompts "
        f"of {min(lengths)}-{max(lengths)} tokens x {n} samples, {new} new tokens each (stops "
        f"off), {len(rows)} rows; median of {args.repeats} repetitions, interleaved. "
        "*model.generate*: one left-padded batch of every row. *engine, batched*: HFEngine's "
        "default path, each prompt prefilled once, its KV cache repeated over its samples "
        "and every row decoded in one left-padded batch. *engine, reuse off*: every row "
        "prefills its own prompt, and the engine then decodes one prompt at a time (its "
        "batched path is the prefix-reuse path). *1 token* is the time of a call that "
        "generates one token (the prefill); *decode per step* = (the full call - the 1-token "
        "call) / (new tokens - 1): the cost of one decoding step of all rows, which is where "
        "the engine's own per-token work (log-probs, entropies, per-row stops, Python) shows."
    )
    print(
        report.table(
            [
                "decoder",
                "ms",
                "generated tok/s",
                "time / model.generate",
                "1 token ms",
                "decode ms/step",
                "decode / model.generate",
            ],
            table,
        )
    )
    report.data["overhead"] = {
        "model": name,
        "device": str(device),
        "prompt_tokens": lengths,
        "samples": n,
        "new_tokens": new,
        "timings": {m: tm[(m, new)].__dict__ for m in methods},
        "one_token": {m: tm[(m, 1)].__dict__ for m in methods},
        "decode_ms_per_step": {m: decode(m) for m in methods},
    }


def _rollout_rows(args: argparse.Namespace, report: Report) -> list:
    """Grow the same trees serially and batched; tokens/s, env steps/s and the speed-up."""
    import gymnasium as gym

    from branchgym.agents.engines.hf import HFEngine
    from branchgym.agents.policies.policy import LLMPolicy
    from branchgym.rollout.batch import BatchStats, grow_trees_batched
    from branchgym.rollout.grow import grow_tree, spec_of

    model, tok, name = _model(args.rollout_model)
    env = gym.make("branchgym/TextTreeMDP-v0", max_episode_steps=args.rollout_steps)
    recipe = spec_of(env)
    env.close()
    seeds = list(range(args.rollout_prompts))
    kw = {
        "m": args.rollout_m,
        "k": args.rollout_k,
        "schedule_options": {"gap_unit": "steps"},
    }

    # The prefix LRU holds 16 contexts per tree for both runs (a serial run needs 16 in
    # all, P trees in lockstep need them at once), so every sibling still finds the
    # backbone's KV cache at its branch point.
    entries = 16 * args.rollout_prompts

    def policy(batch_prompts: bool) -> LLMPolicy:
        eng = HFEngine(
            model,
            tok,
            threads=args.threads,
            batch_prompts=batch_prompts,
            prefix_cache_entries=entries,
        )
        return LLMPolicy(eng, max_new_tokens=args.rollout_new_tokens)

    policy(True).act([], np.random.default_rng(0))  # import and warm-up outside the timing
    grow_tree(recipe, policy(False), "entropy", seed=0, rng=0, m=0)

    t0 = time.perf_counter()
    serial = [
        grow_tree(
            recipe, policy(False), "entropy", seed=s, rng=s, executor=args.rollout_executor, **kw
        )
        for s in tqdm(seeds, desc="engine bench: serial trees", leave=False)
    ]
    serial_s = time.perf_counter() - t0
    stats = BatchStats()
    t0 = time.perf_counter()
    batched = grow_trees_batched(
        recipe, policy(True), seeds, "entropy", executor=args.rollout_executor, stats=stats, **kw
    )
    batched_s = time.perf_counter() - t0

    def totals(trees: list) -> tuple[int, int]:
        return sum(t.stats.generated_tokens for t in trees), sum(t.stats.env_steps for t in trees)

    same = all(
        [n.token_ids.tolist() for n in a] == [n.token_ids.tolist() for n in b]
        for a, b in zip(serial, batched, strict=True)
    )
    rows, data = [], {}
    for label, trees, secs in (("serial", serial, serial_s), ("batched", batched, batched_s)):
        tokens, steps = totals(trees)
        data[label] = {
            "seconds": secs,
            "generated_tokens": tokens,
            "env_steps": steps,
            "tokens_per_s": tokens / secs,
            "env_steps_per_s": steps / secs,
        }
        rows.append(
            [
                f"{label} {name}",
                args.rollout_prompts,
                sum(t.stats.rollouts for t in trees),
                tokens,
                steps,
                f"{secs:.2f}",
                f"{tokens / secs:.1f}",
                f"{steps / secs:.2f}",
                "" if label == "serial" else f"{serial_s / batched_s:.2f}x",
            ]
        )
    data["speedup"] = serial_s / batched_s
    data["same_trees"] = same
    data["policy_calls_batched"] = stats.policy_calls
    data["requests_batched"] = stats.requests
    report.data["rollouts"] = {
        "model": name,
        "prompts": args.rollout_prompts,
        "m": args.rollout_m,
        "k": args.rollout_k,
        "new_tokens": args.rollout_new_tokens,
        "max_steps": args.rollout_steps,
        "executor": args.rollout_executor,
        **data,
    }
    report.add(
        f"## Batched rollouts\n\n{args.rollout_prompts} BPO trees (M={args.rollout_m}, "
        f"K={args.rollout_k}) on TextTreeMDP (at most {args.rollout_steps} decisions per "
        f"rollout, {args.rollout_new_tokens} tokens per action), HF {name}, executor "
        f"{args.rollout_executor}, a prefix LRU of {entries} contexts. *serial*: trees "
        "one after another, one prompt decoded at a time; *batched*: every tree in "
        "lockstep, one engine call per turn "
        f"({stats.policy_calls} calls for {stats.requests} requests). Same trees both ways: "
        f"{'yes' if same else 'NO'}."
    )
    print(
        report.table(
            [
                "rollouts",
                "trees",
                "paths",
                "gen tokens",
                "env steps",
                "s",
                "tok/s",
                "env steps/s",
                "speed-up",
            ],
            rows,
        )
    )
    print(
        f"batched rollouts: {serial_s / batched_s:.2f}x faster than serial "
        f"({stats.policy_calls} engine calls for {stats.requests} requests; same trees: "
        f"{'yes' if same else 'no'})"
    )
    return rows


def main(args: argparse.Namespace) -> int:
    """Run the study and write ``<out>/engine.md``."""
    if args.prefix is None:
        args.prefix = [1000] if args.quick else [250, 1000]
    if args.quick:
        args.repeats = 1
    report = Report(args.out, "engine", "branchgym bench engine")
    if "rollouts" in args.sections:
        _rollout_rows(args, report)
    if "overhead" in args.sections:
        if args.quick:
            args.overhead_prompts, args.overhead_samples = 2, 2
            args.overhead_prompt_tokens = min(args.overhead_prompt_tokens, 32)
        _overhead_rows(args, report)
    if "prefix" not in args.sections:
        path = report.save()
        print(f"\nreport: {path}")
        return 0
    rows, data, model, tok, name = _hf_rows(args, report)
    rows += _vllm_rows(args, model, tok, name)
    report.add(
        f"## Sibling generation at a shared prefix\n\n{args.siblings} siblings x "
        f"{args.new_tokens} new tokens each, median of {args.repeats} repetitions (ms). "
        "*recompute*: the prefix is prefilled once per sibling (no reuse); *reuse*: one "
        "prefill shared by the siblings; *cached*: the backbone already prefilled it "
        "(vLLM: prefix caching off vs on, the backbone's request first). Target: reuse "
        ">= 1.5x faster than recompute at a 1,000-token prefix on CPU."
    )
    print(
        report.table(
            [
                "engine",
                "prefix",
                "recompute ms",
                "reuse ms",
                "cached ms",
                "tok/s recompute / reuse",
                "reuse speed-up",
                "cached speed-up",
            ],
            rows,
        )
    )
    if data:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        xs = sorted(data)
        for m in ("recompute", "reuse", "cached"):
            ax.plot(xs, [data[x][m]["median_ms"] for x in xs], "o-", label=m)
        ax.set_xlabel("shared prefix (tokens)")
        ax.set_ylabel(f"ms for {args.siblings} siblings")
        ax.set_title(f"HF {name}: sibling generation")
        ax.legend(fontsize=8)
        report.figure(fig, "prefix", "Sibling generation time by prefix length, HF engine")
    path = report.save()
    print(f"\nreport: {path}")
    return 0
