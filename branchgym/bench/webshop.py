"""WebShop benchmarks: snapshot cost by catalog size, and the scripted expert's reward.

* :func:`section_webshop` is a section of ``branchgym bench snapshot``: snapshot, restore
  and step times and snapshot bytes over many states of seeded random episodes, on the
  generated catalog at 1,000 and 100,000 products (``--quick``: 1,000 only), against
  the targets (snapshot + restore under 1 ms median, snapshot under 2 KB, a step under
  5 ms median at 1,000 products) and the 42 ms the BPO source reports.
* ``branchgym bench webshop`` (:func:`configure`, :func:`main`) runs the scripted expert
  on every goal of a split (default: the 500 test goals) and reports its mean reward,
  success rate and the reward's components, with a histogram.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import gymnasium as gym
import numpy as np
from tqdm import tqdm

from branchgym.bench import source
from branchgym.bench.common import Report, Timing

__all__ = ["section_webshop", "measure_webshop", "configure", "main", "TARGETS"]

#: Targets of the WebShop issue, checked at 1,000 products.
TARGETS = {"snapshot_restore_ms": 1.0, "snapshot_bytes": 2048, "step_ms": 5.0}
SOURCE_MS = source.SNAPSHOT_MS["branchgym/WebShop-v0"]  # the BPO source's WebShop figure


def measure_webshop(n_products: int, *, episodes: int, seed: int) -> dict[str, Any]:
    """Time snapshot/restore at every state of ``episodes`` seeded random episodes."""
    t0 = time.perf_counter()
    env = gym.make("branchgym/WebShop-v0", generated_products=n_products, split="all")
    env.unwrapped.catalog.index  # noqa: B018 - build or load the index before timing
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    snap_t, rest_t, pair_t, nbytes = [], [], [], []
    step_t: dict[str, list[float]] = {"search": [], "click": []}
    replay_t, depths = [], []
    for ep in tqdm(range(episodes), desc=f"webshop bench: {n_products:,} products", unit="ep"):
        _, info = env.reset(seed=seed + ep)
        actions: list[str] = []
        done = False
        while not done:
            t0 = time.perf_counter()
            snap = env.snapshot()
            t1 = time.perf_counter()
            env.restore(snap)
            t2 = time.perf_counter()
            snap_t.append(t1 - t0)
            rest_t.append(t2 - t1)
            pair_t.append(t2 - t0)
            nbytes.append(snap.nbytes)
            snap.release()
            acts = info["admissible_actions"]
            # a shopper that mostly browses: Buy Now rarely, so episodes run deep
            choices = [a for a in acts if a != "click[buy now]"] or acts
            if "click[buy now]" in acts and rng.random() < 0.15:
                choices = ["click[buy now]"]
            action = choices[int(rng.integers(len(choices)))]
            t0 = time.perf_counter()
            _, _, term, trunc, info = env.step(action)
            step_t["search" if action.startswith("search[") else "click"].append(
                time.perf_counter() - t0
            )
            actions.append(action)
            done = term or trunc
        # the alternative to a snapshot: reset and replay to the state before the end
        prefix = actions[:-1]
        t0 = time.perf_counter()
        env.reset(seed=seed + ep)
        for a in prefix:
            env.step(a)
        replay_t.append(time.perf_counter() - t0)
        depths.append(len(prefix))
    env.close()
    all_steps = step_t["search"] + step_t["click"]
    return {
        "products": n_products,
        "load_s": load_s,
        "states": len(pair_t),
        "snapshot": Timing.of(snap_t),
        "restore": Timing.of(rest_t),
        "pair": Timing.of(pair_t),
        "bytes_median": int(np.median(nbytes)),
        "bytes_max": int(np.max(nbytes)),
        "step": Timing.of(all_steps),
        "step_search": Timing.of(step_t["search"]),
        "step_click": Timing.of(step_t["click"]),
        "replay": Timing.of(replay_t),
        "replay_depth": float(np.mean(depths)),
    }


def _verdict(ok: bool) -> str:
    return "yes" if ok else "NO"


def section_webshop(report: Report, args: argparse.Namespace) -> None:
    """WebShop snapshot cost at 1,000 and 100,000 products (``--quick``: 1,000 only)."""
    scales = [1_000] if args.quick else [1_000, 100_000]
    episodes = max(5, args.repeats) if args.quick else max(30, 2 * args.repeats)
    results = [measure_webshop(n, episodes=episodes, seed=args.seed) for n in scales]
    rows = []
    for m in results:
        rows.append(
            [
                f"{m['products']:,}",
                m["states"],
                f"{m['snapshot'].median_ms:.3f} / {m['snapshot'].p90_ms:.3f}",
                f"{m['restore'].median_ms:.3f} / {m['restore'].p90_ms:.3f}",
                f"{m['pair'].median_ms:.3f}",
                f"{m['bytes_median']} / {m['bytes_max']}",
                f"{m['step'].median_ms:.3f} / {m['step'].p90_ms:.3f}",
                f"{m['step_search'].median_ms:.3f}",
                f"{m['step_click'].median_ms:.3f}",
                f"{m['replay'].median_ms:.2f} (depth {m['replay_depth']:.1f})",
                f"{m['load_s']:.1f} s",
                f"{SOURCE_MS / max(m['pair'].median_ms, 1e-9):,.0f}x",
            ]
        )
    report.add(
        "## WebShop: snapshot cost by catalog size\n\n"
        f"Generated catalogs; {episodes} seeded random-shopper episodes each, a snapshot + "
        "restore at every state (median / p90, ms). *Bytes* are the pickled snapshot "
        "(median / max). *Replay* resets and replays the episode to its last state. "
        "*Load* is the first `gym.make` (catalog and index from the disk cache, or built). "
        f"*vs source* divides the BPO source's {SOURCE_MS:.0f} ms by our median snapshot + "
        "restore."
    )
    print(
        report.table(
            [
                "products",
                "states",
                "snapshot ms",
                "restore ms",
                "snap+restore ms",
                "bytes",
                "step ms",
                "search step ms",
                "click step ms",
                "replay ms",
                "load",
                "vs source",
            ],
            rows,
        )
    )
    small = results[0]
    checks = [
        [
            "snapshot + restore median < 1 ms",
            f"{small['pair'].median_ms:.3f} ms",
            _verdict(small["pair"].median_ms < TARGETS["snapshot_restore_ms"]),
        ],
        [
            "snapshot < 2 KB",
            f"{small['bytes_max']} B (max)",
            _verdict(small["bytes_max"] < TARGETS["snapshot_bytes"]),
        ],
        [
            "step median < 5 ms",
            f"{small['step'].median_ms:.3f} ms",
            _verdict(small["step"].median_ms < TARGETS["step_ms"]),
        ],
    ]
    report.add("Targets at 1,000 products:")
    print(report.table(["target", "measured", "met"], checks))
    report.data["webshop"] = [
        {k: (v.__dict__ if isinstance(v, Timing) else v) for k, v in m.items()} for m in results
    ]
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    labels = ["snapshot", "restore", "click step", "search step", "replay"]
    keys = ["snapshot", "restore", "step_click", "step_search", "replay"]
    x = np.arange(len(labels))
    width = 0.8 / len(results)
    for j, m in enumerate(results):
        ax.bar(x + j * width, [m[k].median_ms for k in keys], width, label=f"{m['products']:,}")
    ax.axhline(SOURCE_MS, color="k", ls="--", lw=1, label=f"source snapshot ({SOURCE_MS:.0f} ms)")
    ax.set_xticks(x + width * (len(results) - 1) / 2, labels)
    ax.set_yscale("log")
    ax.set_ylabel("median ms (log)")
    ax.legend(fontsize=8, title="products", title_fontsize=8)
    report.figure(fig, "webshop", "WebShop: median cost per operation by catalog size")


# ------------------------------------------------------------- search agreement


def exact_bm25_ranking(index: Any, query: str, k: int = 10) -> tuple[int, ...]:
    """A plain BM25 reference ranking: the top ``k`` documents for ``query``.

    Same analyzer, postings and k1/b as ``index``, but exact document lengths and double
    precision throughout (no one-byte norms, no float32); ties by document id. Used to
    measure what Lucene's encoding changes.
    """
    from collections import Counter

    from branchgym.envs.webshop.search import K1, B, analyze

    n = index.n_docs
    avgdl = float(index.lengths.sum()) / max(n, 1)
    scores: dict[int, float] = {}
    for term, boost in Counter(t for t in analyze(query) if t in index.vocab).items():
        t = index.vocab[term]
        lo, hi = int(index.indptr[t]), int(index.indptr[t + 1])
        idf = float(np.log(1.0 + (n - (hi - lo) + 0.5) / ((hi - lo) + 0.5)))
        for d, tf in zip(index.docs[lo:hi].tolist(), index.tfs[lo:hi].tolist(), strict=True):
            dl = float(index.lengths[d])
            norm = K1 * ((1 - B) + B * dl / avgdl)
            scores[d] = scores.get(d, 0.0) + boost * idf * tf / (tf + norm)
    return tuple(sorted(scores, key=lambda d: (-scores[d], d))[:k])


def search_agreement(catalog: Any, queries: list[str], page: int = 10) -> dict[str, float]:
    """How often the Lucene-arithmetic index and :func:`exact_bm25_ranking` agree.

    Returns the share of queries whose first results page (``page`` hits) is identical
    in order, identical as a set, whose top hit agrees, and the mean overlap of page 1.
    """
    idx = catalog.index
    same_order = same_set = top1 = 0
    overlap = 0.0
    for q in queries:
        ours = idx.search(q)[:page]
        ref = exact_bm25_ranking(idx, q, page)
        same_order += ours == ref
        same_set += set(ours) == set(ref)
        top1 += ours[:1] == ref[:1]
        overlap += len(set(ours) & set(ref)) / max(len(ref), 1)
    n = max(len(queries), 1)
    return {
        "queries": len(queries),
        "page1_same_order": same_order / n,
        "page1_same_set": same_set / n,
        "top1_same": top1 / n,
        "page1_overlap": overlap / n,
    }


def _agreement_rows(catalog: Any, goals: range) -> tuple[dict[str, dict], list[list]]:
    instr = [catalog.goals[i]["instruction_text"].lower() for i in goals]
    kinds = {
        "instructions": instr,
        "goal queries": [catalog.goals[i]["query"] for i in goals],
        "goal query + attributes": [
            f"{catalog.goals[i]['query']} {' '.join(catalog.goals[i]['attributes'])}" for i in goals
        ],
    }
    out, rows = {}, []
    for name, qs in kinds.items():
        a = search_agreement(catalog, qs)
        out[name] = a
        rows.append(
            [
                name,
                a["queries"],
                f"{a['page1_same_order']:.3f}",
                f"{a['page1_same_set']:.3f}",
                f"{a['top1_same']:.3f}",
                f"{a['page1_overlap']:.3f}",
            ]
        )
    return out, rows


# ------------------------------------------------------------- noun agreement


def noun_agreement(catalog: Any, goals: range | list[int], nlp: Any, page: int = 10) -> dict:
    """How closely :func:`~branchgym.envs.webshop.reward.heuristic_nouns` follows spaCy.

    Two levels, on the catalog's titles and the split's goals:

    * tokens: over every product title, the heuristic's noun list against spaCy's
      ``NOUN``/``PROPN`` tokens (``nlp``): micro precision and recall, and the share of
      titles whose noun sets are equal;
    * the type factor: for each goal and each product on the first results page of its
      instruction (what an agent buys from), upstream's ``r_type`` computed with both noun
      lists; the share of (goal, product) pairs where it is equal, and the mean absolute
      difference of ``title_score``.
    """
    from branchgym.envs.webshop.reward import get_type_reward, heuristic_nouns, spacy_nouns

    tp = fp = fn = same = 0
    titles = [str(p["name"]) for p in catalog.products]
    for title in titles:
        h, sp = set(heuristic_nouns(title)), set(spacy_nouns(nlp, title))
        tp += len(h & sp)
        fp += len(h - sp)
        fn += len(sp - h)
        same += h == sp
    pairs = equal = 0
    score_gap = 0.0
    flips: dict[str, int] = {}
    for gi in goals:
        goal = catalog.goals[gi]
        g_h = {**goal, "name_nouns": heuristic_nouns(goal["name"])}
        g_s = {**goal, "name_nouns": spacy_nouns(nlp, goal["name"])}
        for d in catalog.index.search(goal["instruction_text"].lower())[:page]:
            prod = catalog.products[d]
            a = get_type_reward({**prod, "title_nouns": heuristic_nouns(prod["name"])}, g_h)
            b = get_type_reward({**prod, "title_nouns": spacy_nouns(nlp, prod["name"])}, g_s)
            pairs += 1
            equal += a["r_type"] == b["r_type"]
            score_gap += abs(a["title_score"] - b["title_score"])
            if a["r_type"] != b["r_type"]:
                key = f"{b['r_type']} -> {a['r_type']}"
                flips[key] = flips.get(key, 0) + 1
    return {
        "model": f"{nlp.meta.get('name', '?')} {nlp.meta.get('version', '')}".strip(),
        "titles": len(titles),
        "token_precision": tp / max(tp + fp, 1),
        "token_recall": tp / max(tp + fn, 1),
        "titles_same_nouns": same / max(len(titles), 1),
        "pairs": pairs,
        "r_type_same": equal / max(pairs, 1),
        "title_score_mean_abs_diff": score_gap / max(pairs, 1),
        "r_type_flips_spacy_to_heuristic": flips,
    }


def _noun_section(report: Report, catalog: Any, goals: range) -> None:
    from branchgym.envs.webshop.reward import spacy_pipeline

    nlp = spacy_pipeline()
    if nlp is None:
        print(
            "\nTitle nouns: spaCy with an English model is not installed, so the heuristic's "
            "agreement with it cannot be measured here (pip install "
            "'branchgym[webshop-spacy]' and a model wheel; see docs/webshop.md)."
        )
        return
    a = noun_agreement(catalog, goals, nlp)
    report.add(
        f"Title nouns: the token heuristic against spaCy ({a['model']}) on the catalog's "
        f"{a['titles']:,} titles, and upstream's type factor r_type computed with each on "
        f"{a['pairs']:,} (goal, page-1 result) pairs."
    )
    rows = [
        ["token precision (heuristic nouns that spaCy tags)", f"{a['token_precision']:.3f}"],
        ["token recall (spaCy nouns the heuristic keeps)", f"{a['token_recall']:.3f}"],
        ["titles with the same noun set", f"{a['titles_same_nouns']:.3f}"],
        ["(goal, result) pairs with the same r_type", f"{a['r_type_same']:.3f}"],
        ["mean |title_score difference|", f"{a['title_score_mean_abs_diff']:.3f}"],
        [
            "r_type changes (spaCy -> heuristic)",
            ", ".join(f"{k}: {v}" for k, v in sorted(a["r_type_flips_spacy_to_heuristic"].items()))
            or "none",
        ],
    ]
    print(report.table(["figure", "value"], rows))
    report.data["noun_agreement"] = a


# ------------------------------------------------------------------ expert study


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``branchgym bench webshop``."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument("--split", default="test", help="goal split (default: test, 500 goals)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N goals")
    parser.add_argument("--data-dir", default=None, help="real WebShop data folder")
    parser.add_argument(
        "--data",
        choices=("small", "full"),
        default=None,
        help="which upstream release in --data-dir (needed when the folder holds both)",
    )
    parser.add_argument("--quick", action="store_true", help="first 50 goals only (CI)")
    parser.add_argument(
        "--nouns-only",
        action="store_true",
        help="only the title-noun agreement (heuristic vs spaCy; needs spaCy and a model)",
    )


def main(args: argparse.Namespace) -> int:
    """Run the scripted expert on a goal split and report its reward."""
    from branchgym.envs.webshop.expert import run_expert

    env = gym.make("branchgym/WebShop-v0", data_dir=args.data_dir, data=args.data, split=args.split)
    n = len(env.unwrapped.split_goals)
    limit = 50 if args.quick else args.limit
    goals = range(min(n, limit) if limit else n)
    if args.nouns_only:
        report = Report(args.out, "webshop_nouns", "branchgym bench webshop: title nouns")
        _noun_section(report, env.unwrapped.catalog, env.unwrapped.split_goals[: len(goals)])
        print(f"\nreport: {report.save()}")
        return 0
    t0 = time.perf_counter()
    res = run_expert(env, goals, split=args.split, progress=True)
    secs = time.perf_counter() - t0
    report = Report(args.out, "webshop", "branchgym bench webshop: the scripted expert")
    cat = env.unwrapped.catalog
    report.add(
        f"Catalog: {cat.source} ({len(cat):,} products, {len(cat.goals):,} goals). Split "
        f"{args.split!r}: {len(goals)} goals. The expert searches with the instruction, "
        "opens the result whose title shares most words with it (within budget), clicks "
        "the option values the instruction names, and buys."
    )
    rewards = np.array(res.rewards)
    rows = [
        ["goals", len(rewards)],
        ["mean reward", f"{res.mean:.4f}"],
        ["success rate (reward = 1)", f"{res.success_rate:.3f}"],
        ["bought the goal's own product", f"{np.mean(res.exact):.3f}"],
        ["mean steps", f"{np.mean(res.steps):.2f}"],
        ["episodes per second", f"{len(rewards) / secs:.0f}"],
    ]
    print(report.table(["figure", "value"], rows))
    agreement, arows = _agreement_rows(cat, env.unwrapped.split_goals[: len(goals)])
    report.add(
        "Search: page-1 agreement between the index (Lucene's one-byte length norms and "
        "float32 arithmetic) and a plain exact-length double-precision BM25 reference, "
        "same analyzer, on the split's goals. Disagreements are near-ties that Lucene's "
        "length encoding reorders."
    )
    print(
        report.table(
            ["queries", "n", "same order", "same set", "same top hit", "mean overlap"], arows
        )
    )
    report.data["search_agreement"] = agreement
    _noun_section(report, cat, env.unwrapped.split_goals[: len(goals)])
    report.data["expert"] = {
        "split": args.split,
        "rewards": res.rewards,
        "mean": res.mean,
        "success_rate": res.success_rate,
    }
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.hist(rewards, bins=np.linspace(0, 1, 21), color="tab:blue")
    ax.axvline(res.mean, color="k", ls="--", lw=1, label=f"mean {res.mean:.3f}")
    ax.set_xlabel("reward")
    ax.set_ylabel("episodes")
    ax.legend(fontsize=8)
    report.figure(fig, "expert", f"Scripted expert's reward on the {args.split} goals")
    path = report.save()
    print(f"\nreport: {path}")
    return 0
