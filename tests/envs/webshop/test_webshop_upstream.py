"""WebShop upstream fidelity (issue 19): data resolution, splits, info, history options."""

import json
import subprocess
import sys

import gymnasium as gym
import pytest

from branchgym.envs.webshop import ScriptedExpert, WebShopEnv, load_catalog
from branchgym.envs.webshop.data import clear_catalog_cache
from branchgym.error import DataError
from tests.envs.webshop import webshop_data

SMALL = ("items_shuffle_1000.json", "items_ins_v2_1000.json")
FULL = ("items_shuffle.json", "items_ins_v2.json")


def layout(folder, *names, full_extra=3):
    """An upstream-layout folder holding ``names``: the small release is the fixture's
    13 products, the full one adds ``full_extra`` products with their own attributes."""
    folder.mkdir(parents=True, exist_ok=True)
    extra = [
        dict(webshop_data.PRODUCTS[3], asin=f"B000FULL{i:02d}", name=f"Full Only Shampoo {i}")
        for i in range(full_extra)
    ]
    full_attrs = dict(webshop_data.ATTRIBUTES)
    full_attrs.update({p["asin"]: {"attributes": ["full release"]} for p in extra})
    content = {
        SMALL[0]: webshop_data.PRODUCTS,
        SMALL[1]: webshop_data.ATTRIBUTES,
        FULL[0]: webshop_data.PRODUCTS + extra,
        FULL[1]: full_attrs,
        "items_human_ins.json": webshop_data.HUMAN,
    }
    for name in (*names, "items_human_ins.json"):
        (folder / name).write_text(json.dumps(content[name]), encoding="utf-8")
    return folder


# ------------------------------------------------------------------ data resolution


def test_both_releases_present_is_an_error_naming_both(tmp_path):
    d = layout(tmp_path, *SMALL, *FULL)
    with pytest.raises(DataError, match="several WebShop data files") as exc:
        load_catalog(d)
    msg = str(exc.value)
    assert all(name in msg for name in (*SMALL, *FULL))
    assert "complete releases here: small, full" in msg and "data='small'" in msg


def test_presets_pick_their_own_pair(tmp_path):
    d = layout(tmp_path, *SMALL, *FULL)
    small, full = load_catalog(d, data="small"), load_catalog(d, data="full")
    assert (len(small), small.files) == (13, SMALL)
    assert (len(full), full.files) == (16, FULL)
    assert full.products[full.asin_index["B000FULL00"]]["Attributes"] == ["full release"]
    # products_file alone is paired with its own release's attributes file
    alone = load_catalog(d, products_file="items_shuffle.json")
    assert alone.files == FULL and "DUMMY_ATTR" not in str(
        [p["Attributes"] for p in alone.products[-3:]]
    )
    assert load_catalog(d, attributes_file=SMALL[1]).files == SMALL
    env = WebShopEnv(data_dir=str(d), data="full", split="all")
    assert len(env.catalog) == 16


def test_missing_or_mismatched_files_are_errors(tmp_path):
    with pytest.raises(DataError, match="not a complete WebShop data folder") as exc:
        load_catalog(layout(tmp_path / "a", SMALL[0]))
    assert "items_shuffle_1000.json" in str(exc.value) and "attributes files none" in str(exc.value)
    d = layout(tmp_path / "b", *SMALL, FULL[0])
    with pytest.raises(DataError, match=r"attributes file .*items_ins_v2.json' does not exist"):
        load_catalog(d, data="full")
    with pytest.raises(DataError, match="several WebShop data files"):
        load_catalog(d)  # two products files, one attributes file: still ambiguous
    assert load_catalog(d, data="small").files == SMALL
    with pytest.raises(DataError, match="different releases"):
        load_catalog(layout(tmp_path / "c", FULL[0], SMALL[1]))
    mixed = load_catalog(tmp_path / "c", products_file=FULL[0], attributes_file=SMALL[1])
    assert mixed.files == (FULL[0], SMALL[1])  # named explicitly: the user's choice
    with pytest.raises(DataError, match="unknown WebShop data preset 'tiny'"):
        load_catalog(d, data="tiny")
    with pytest.raises(DataError, match="not both"):
        load_catalog(d, data="small", products_file=SMALL[0])
    with pytest.raises(DataError, match="products file .*nope.json' does not exist"):
        load_catalog(d, products_file="nope.json", attributes_file=SMALL[1])
    # a custom-named file pairs with the only file of the other kind, or asks for its name
    e = layout(tmp_path / "e", *SMALL, FULL[1])
    (e / "items_shuffle_mine.json").write_text((e / SMALL[0]).read_text(), encoding="utf-8")
    with pytest.raises(
        DataError, match="products_file='items_shuffle_mine.json' has no matching attributes file"
    ) as exc:
        load_catalog(e, products_file="items_shuffle_mine.json")
    assert "name it with attributes_file=" in str(exc.value)
    (e / FULL[1]).unlink()
    assert load_catalog(e, products_file="items_shuffle_mine.json").files == (
        "items_shuffle_mine.json",
        SMALL[1],
    )
    (e / "items_ins_v2_mine.json").write_text((e / SMALL[1]).read_text(), encoding="utf-8")
    with pytest.raises(
        DataError, match="attributes_file='items_ins_v2_mine.json' has no matching products file"
    ):
        load_catalog(e, attributes_file="items_ins_v2_mine.json")


# ------------------------------------------------------------------------- splits


def test_splits_follow_upstreams_num_products_rule():
    cat = load_catalog()
    n = len(cat.goals)
    assert n > 1500 and cat.num_products is None
    assert cat.split_range("train") == range(1500, n)
    capped = load_catalog(num_products=1000)  # upstream's --num set: every split is all goals
    m = len(capped.goals)
    for split in ("test", "eval", "train", "all"):
        assert capped.split_range(split) == range(m)
    assert capped.split_range("agent_test") == range(500)  # the agent convention, always
    env = gym.make("branchgym/WebShop-v0", split="agent_test")
    _, info = env.reset(options={"goal_index": 499})
    assert (info["split"], info["goal_index"], info["split_index"]) == ("agent_test", 499, 499)


def test_price_bounds_are_identical_across_processes(tmp_path):
    d = webshop_data.write_catalog(tmp_path)
    cat = load_catalog(d)
    clear_catalog_cache()
    assert load_catalog(d).fingerprint == cat.fingerprint
    code = (
        "from branchgym.envs.webshop import load_catalog; import sys; "
        "c = load_catalog(sys.argv[1]); print(c.fingerprint, [g['price_upper'] for g in c.goals])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(d)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    ).stdout.split(" ", 1)
    assert out[0] == cat.fingerprint
    assert out[1].strip() == str([g["price_upper"] for g in cat.goals])


# ------------------------------------------------------------------ info, history


def test_won_is_reward_exactly_one_and_survives_restore():
    env = gym.make("branchgym/WebShop-v0", split="test")
    expert, won = ScriptedExpert(), []
    for i in range(0, 60, 3):
        _, info = env.reset(options={"goal_index": i})
        expert.reset()
        done = False
        while not done:
            action = expert.act(env.unwrapped.page, info["instruction"])
            _, reward, term, trunc, info = env.step(action)
            done = term or trunc
            if not done:
                assert info["won"] is False
        assert info["won"] == (term and reward == 1) and info["split"] == "test"
        won.append(info["won"])
    assert any(won) and not all(won)


def _fixture_env(data_dir, **kw):
    env = WebShopEnv(data_dir=data_dir, split="all", max_steps=40, **kw)
    obs, _ = env.reset(options={"goal_index": 1})
    return env, obs


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(webshop_data.write_catalog(tmp_path_factory.mktemp("webshop_up")))


def test_invalid_action_observation_can_be_upstreams(data_dir):
    env, obs0 = _fixture_env(data_dir, invalid_action_obs="upstream")
    obs, reward, term, trunc, info = env.step("click[nothing here]")
    assert obs == obs0 and (reward, term, trunc) == (0.0, False, False)
    assert info["invalid_action"] and env.state.step == 1
    default, _ = _fixture_env(data_dir)
    assert default.step("click[nothing here]")[0].startswith("Invalid action")
    with pytest.raises(ValueError, match="invalid_action_obs"):
        WebShopEnv(data_dir=data_dir, split="all", invalid_action_obs="silent")
    with pytest.raises(ValueError, match="num_prev_obs"):
        WebShopEnv(data_dir=data_dir, split="all", num_prev_obs=-1)


def test_history_options_use_upstreams_format(data_dir):
    plain, o0 = _fixture_env(data_dir)
    a1, a2 = "search[acme tea tree shampoo]", "click[b000test01]"
    o1 = plain.step(a1)[0]
    o2 = plain.step(a2)[0]
    sep = " [SEP] "

    env, first = _fixture_env(data_dir, num_prev_obs=1, num_prev_actions=1)
    assert first == o0  # reset shows no history, as upstream
    assert env.step(a1)[0] == sep.join([o0, a1, o1])
    assert env.step(a2)[0] == sep.join([o1, a2, o2])

    env, _ = _fixture_env(data_dir, num_prev_obs=2, num_prev_actions=2)
    env.step(a1)
    assert env.step(a2)[0] == sep.join([o0, a1, o1, a2, o2])

    env, _ = _fixture_env(data_dir, num_prev_actions=3)
    env.step(a1)
    assert env.step(a2)[0] == sep.join([a1, a2, o2])
    assert env.state.prev_obs == ()  # no observation kept when none is shown

    env, _ = _fixture_env(data_dir, num_prev_obs=1, num_prev_actions=1)
    env.step(a1)
    with env.snapshot() as snap:
        then = env._obs
        env.step(a2)
        env.step("click[back to search]")
        assert env.restore(snap)[0] == then
        assert env.step(a2)[0] == sep.join([o1, a2, o2])
    other, _ = _fixture_env(data_dir)
    with env.snapshot() as snap, pytest.raises(Exception, match="differ"):
        other.restore(snap)  # a different history setting is a different env


# ------------------------------------------------------------------------- search


def test_tokenizer_follows_standard_tokenizer():
    from branchgym.envs.webshop.search import tokenize

    assert tokenize("Only $1,299.99 for the T-Shirt!") == [
        "only",
        "1,299.99",
        "for",
        "the",
        "t",
        "shirt",
    ]
    assert tokenize("don't l'eau runner\u2019s U.S.A. 64GB 6.76oz") == [
        "don't", "l'eau", "runner\u2019s", "u.s.a", "64gb", "6.76oz",
    ]  # fmt: skip
    assert tokenize("size:large 16:9 a,b 1,2 80's x-large 3-pack") == [
        "size:large", "16", "9", "a", "b", "1,2", "80", "s", "x", "large", "3", "pack",
    ]  # fmt: skip
    assert tokenize("茶叶 tea") == ["茶", "叶", "tea"] and tokenize("a" * 300) == [
        "a" * 255,
        "a" * 45,
    ]


def test_length_norms_are_lucenes_small_float():
    from branchgym.envs.webshop.search import byte4_to_int, int_to_byte4

    assert [int_to_byte4(n) for n in range(24)] == list(range(24))  # exact below 24
    decoded = [byte4_to_int(b) for b in range(256)]
    assert decoded == sorted(set(decoded)) and decoded[255] == 24 + (15 << 27)
    for n in [*range(200), 1000, 12345, 2**31 - 1]:
        b = int_to_byte4(n)
        assert 0 <= b <= 255 and byte4_to_int(b) <= n  # rounded down ...
        assert b == 255 or byte4_to_int(b + 1) > n  # ... to the largest code not above n
    assert [byte4_to_int(int_to_byte4(n)) for n in (40, 41, 47, 100)] == [40, 40, 46, 96]


def test_scores_are_lucenes_float32_formula(data_dir):
    import numpy as np

    from branchgym.envs.webshop.search import analyze, byte4_to_int, int_to_byte4

    idx = load_catalog(data_dir).index
    q = "acme tea tree shampoo shampoo"
    got = idx.scores(q)
    n, avgdl = idx.n_docs, np.float32(idx.lengths.sum() / idx.n_docs)
    f32 = np.float32
    want = np.zeros(n)
    from collections import Counter

    for term, boost in Counter(analyze(q)).items():
        t = idx.vocab[term]
        docs = idx.docs[idx.indptr[t] : idx.indptr[t + 1]]
        tfs = idx.tfs[idx.indptr[t] : idx.indptr[t + 1]]
        w = f32(boost) * f32(np.log(1 + (n - len(docs) + 0.5) / (len(docs) + 0.5)))
        for d, tf in zip(docs, tfs, strict=True):
            dl = f32(byte4_to_int(int_to_byte4(int(idx.lengths[d]))))
            inv = f32(1) / (f32(0.9) * ((f32(1) - f32(0.4)) + f32(0.4) * dl / avgdl))
            want[d] += float(w - w / (f32(1) + f32(tf) * inv))
    assert np.array_equal(got, want.astype(np.float32))


def test_agreement_with_an_exact_reference(data_dir):
    from branchgym.bench.webshop import exact_bm25_ranking, search_agreement

    cat = load_catalog(data_dir)
    queries = ["filler shampoo", "acme tea tree shampoo", "running shoes navy", "daily"]
    for q in queries:  # short documents: norms are exact, rankings the same
        assert exact_bm25_ranking(cat.index, q, 10) == cat.index.search(q)[:10]
    a = search_agreement(cat, queries)
    assert a["page1_same_order"] == a["top1_same"] == a["page1_overlap"] == 1.0
    big = load_catalog()
    goals = [g["instruction_text"].lower() for g in big.goals[:40]]
    b = search_agreement(big, goals)
    assert b["top1_same"] >= 0.9 and b["page1_overlap"] >= 0.95


# ---------------------------------------------------------------------- title nouns


def test_real_data_graded_with_the_heuristic_warns_once(data_dir, monkeypatch, caplog):
    from branchgym.envs.webshop import reward

    monkeypatch.setattr(reward, "noun_backend", lambda: "heuristic")
    monkeypatch.setattr(reward, "_WARNED", set())
    cat = load_catalog(data_dir)
    with pytest.warns(UserWarning, match="title-noun HEURISTIC"):
        WebShopEnv(data_dir=data_dir, split="all")
    assert "HEURISTIC" in caplog.text and "webshop-spacy" in caplog.text
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per source: no second warning
        WebShopEnv(data_dir=data_dir, split="all")
        assert reward.warn_if_heuristic_on_real_data(cat.source, cat.products)
        gen = load_catalog()  # generated data carries its nouns: nothing to warn about
        assert not reward.warn_if_heuristic_on_real_data(gen.source, gen.products)
    monkeypatch.setattr(reward, "noun_backend", lambda: "spacy:en_core_web_lg")
    monkeypatch.setattr(reward, "_WARNED", set())
    assert not reward.warn_if_heuristic_on_real_data(cat.source, cat.products)


def test_heuristic_nouns_grade_the_type_factor():
    from branchgym.envs.webshop.reward import get_type_reward, heuristic_nouns

    goal = {"query": "a", "product_category": "x › y", "name": "Acme Tea Tree Shampoo"}
    same = {"query": "b", "product_category": "p › q", "name": "Bolt Tea Tree Shampoo 16oz"}
    other = {"query": "b", "product_category": "p › q", "name": "Running Shoes"}
    assert heuristic_nouns(goal["name"]) == ["acme", "tea", "tree", "shampoo"]
    assert get_type_reward(same, goal)["r_type"] == 1.0  # 3 of 4 nouns shared
    assert get_type_reward(other, goal)["r_type"] == 0.0


def test_spacy_nouns_when_a_model_is_installed():
    pytest.importorskip("spacy")
    from branchgym.envs.webshop import reward

    if reward.noun_backend() == "heuristic":
        pytest.skip("no spaCy English model installed (en_core_web_lg/md/sm)")
    assert reward.noun_backend().startswith("spacy:")
    nouns = reward.title_nouns("Organic Green Tea Bags, 100 Count")
    assert "tea" in nouns and "bags" in nouns and "100" not in nouns
