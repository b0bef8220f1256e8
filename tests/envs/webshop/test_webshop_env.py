"""WebShop env: navigation rules, action grammar, goals, snapshots, data loading, expert."""

import hashlib
import io
import json
import pickle

import gymnasium as gym
import pytest

import branchgym
from branchgym.cli import play
from branchgym.envs.webshop import WebShopEnv, load_catalog, run_expert
from branchgym.envs.webshop.data import SPLITS, parse_pricing
from branchgym.envs.webshop.generate import KINDS, write_catalog
from branchgym.envs.webshop.search import LUCENE_STOPWORDS, SearchIndex, analyze
from branchgym.error import (
    DataError,
    ResetNeededError,
    SnapshotCorruptError,
    SnapshotMismatchError,
)
from branchgym.fidelity.checks import check_env
from tests.envs.webshop import webshop_data


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(webshop_data.write_catalog(tmp_path_factory.mktemp("webshop")))


def fixture_env(data_dir, **kw):
    env = WebShopEnv(data_dir=data_dir, split="all", max_steps=kw.pop("max_steps", 40), **kw)
    env.reset(options={"goal_index": 1})
    return env


# ------------------------------------------------------------------ navigation


def test_navigation_rules(data_dir):
    env = fixture_env(data_dir)
    env.step("search[acme tea tree shampoo]")
    env.step("click[b000test01]")
    env.step("click[8 fl oz]")
    env.step("click[16 fl oz]")  # same group: replaces
    env.step("click[tea tree]")
    assert env.state.options == (("size", "16 fl oz"), ("scent", "tea tree"))
    env.step("click[features]")
    env.step("click[< prev]")  # sub-page -> item keeps the options
    assert env.state.page == "item" and len(env.state.options) == 2
    env.step("click[< prev]")  # item -> results resets them
    assert (env.state.page, env.state.options, env.state.item) == ("results", (), -1)
    assert env.state.visited == (0,)  # the visited product is remembered...
    env.step("click[back to search]")  # ...until Back to Search clears everything
    st = env.state
    assert (st.page, st.keywords, st.results, st.item, st.visited) == ("search", None, (), -1, ())
    env.step("search[bolt running shoes]")
    env.step("click[b000test02]")
    obs = env.step("search[acme daily shampoo]")[0]  # search works from any page
    assert env.state.page == "results" and "B000TEST03" in obs


@pytest.mark.parametrize(
    "action",
    [
        "Search[shampoo]",  # the name is case-sensitive
        " search[shampoo]",
        "search[]",
        "search shampoo",
        "click[search]",  # upstream never clicks the search button
        "buy[now]",
        "",
        None,
        42,
    ],
)
def test_invalid_actions_change_nothing_but_the_message(data_dir, action):
    env = fixture_env(data_dir)
    before = env.state
    obs, r, term, trunc, info = env.step(action)
    assert obs.startswith("Invalid action") and obs.endswith("[SEP] Search")
    assert (r, term, trunc, info["invalid_action"], info["page"]) == (
        0.0,
        False,
        False,
        True,
        "search",
    )
    assert env.state.step == before.step + 1  # an invalid action still costs a step


def test_a_huge_action_is_refused_and_not_kept_whole(data_dir):
    env = fixture_env(data_dir)
    obs, *_, info = env.step("search[" + "x" * 1_000_000 + "]")
    assert obs.startswith("Invalid action") and "1000008 characters (limit 4096)" in obs
    assert info["invalid_action"] and env.state.keywords is None
    with env.snapshot() as snap:
        assert snap.nbytes < 10_000  # the state keeps the action's head only
    assert len(env.state.history[-1]) < 200


def test_action_grammar_matches_upstream(data_dir):
    env = fixture_env(data_dir)
    env.step("search[ACME Daily] ignored tail")  # re.match: text after ] is ignored
    assert env.state.keywords == "acme daily"
    env.step("search[ ]")  # a blank query is a search with no hits, as Lucene
    assert env.state.results == () and env.state.page == "results"


def test_step_limit_truncates_and_then_needs_reset(data_dir):
    env = fixture_env(data_dir, max_steps=3)
    for i in range(3):
        *_, trunc, info = env.step("search[shampoo]")
        assert trunc is (i == 2)
    assert info["admissible_actions"] == []
    with pytest.raises(ResetNeededError, match="reset"):
        env.step("search[shampoo]")


def test_step_and_snapshot_before_reset():
    env = WebShopEnv()
    with pytest.raises(ResetNeededError):
        env.step("search[x]")
    with pytest.raises(ResetNeededError):
        env.snapshot()


# ----------------------------------------------------------------------- goals


def test_splits_follow_upstream():
    env = gym.make("branchgym/WebShop-v0")
    cat = env.unwrapped.catalog
    assert SPLITS == {
        "test": (0, 500),
        "eval": (500, 1500),
        "train": (1500, None),
        "all": (0, None),
        "agent_test": (0, 500),
    }
    assert len(cat.split_range("test")) == 500 and len(cat.split_range("eval")) == 1000
    assert len(cat.split_range("train")) == len(cat.goals) - 1500 > 500
    _, info = env.reset(options={"split": "eval", "goal_index": 3})
    assert info["goal_index"] == 503
    _, info = env.reset(options={"split": "test", "goal_index": -1})
    assert info["goal_index"] == 499
    with pytest.raises(DataError, match="outside the 'test' split"):
        env.reset(options={"split": "test", "goal_index": 500})
    with pytest.raises(DataError, match="unknown goal split"):
        env.reset(options={"split": "dev"})
    with pytest.raises(ValueError, match="unknown reset options"):
        env.reset(options={"goal": 1})
    a = env.reset(seed=7)[1]["goal_index"]
    assert a == env.reset(seed=7)[1]["goal_index"] and a >= 1500  # default split: train
    _, info = env.reset(options={"split": "eval", "goal_index": 3})
    assert (info["split"], info["goal_index"], info["split_index"]) == ("eval", 503, 3)
    assert info["won"] is False
    assert env.unwrapped.catalog.split_range("agent_test") == range(500)


def test_goals_have_upstream_fields_and_price_bounds():
    cat = load_catalog()
    for g in cat.goals[:200]:
        assert set(g) >= {
            "asin",
            "category",
            "query",
            "name",
            "product_category",
            "instruction_text",
            "attributes",
            "price_upper",
            "goal_options",
            "weight",
        }
        price = cat.prices[cat.asin_index[g["asin"]]]
        grid = [p for p in range(10, 1000, 10) if p > price][:4]
        assert g["price_upper"] in grid[1:]  # the larger of two of the next four
        assert g["instruction_text"].endswith(
            f", and price lower than {g['price_upper']:.2f} dollars"
        )


def test_goal_shuffle_is_seed_233(data_dir):
    cat = load_catalog(data_dir)
    # two goals: B000TEST01's (first in file order) and B000TEST02's; seed 233 swaps them
    assert [g["asin"] for g in cat.goals] == ["B000TEST02", "B000TEST01"]
    assert cat.goals[1]["instruction_text"].startswith("i need a sulfate free tea tree shampoo")
    assert load_catalog(data_dir, human_goals=False).goals[0]["goal_options"]  # synthetic


def test_empty_split_is_a_typed_error(data_dir):
    with pytest.raises(DataError, match="'train' split is empty") as exc:
        load_catalog(data_dir).split_range("train")
    assert "split='all'" in str(exc.value)


# -------------------------------------------------------------------- snapshots


@pytest.mark.parametrize("mode", ["text_rich", "html"])
def test_check_env_other_modes(mode):
    report = check_env(lambda: gym.make("branchgym/WebShop-v0", observation_mode=mode), seed=5)
    assert report.ok, str(report)


def test_snapshot_is_small_shares_the_catalog_and_restores_anywhere():
    env = gym.make("branchgym/WebShop-v0")
    other = gym.make("branchgym/WebShop-v0")
    assert env.unwrapped.catalog is other.unwrapped.catalog  # one catalog per source
    _, info = env.reset(seed=3)
    for _ in range(4):
        _, _, term, _, info = env.step(info["admissible_actions"][-1])
        assert not term
    obs_then, state_then = env.unwrapped._obs, env.unwrapped.state
    with env.snapshot() as snap:
        assert snap.nbytes < 8192  # memory it holds: no catalog, no page text
        blob = pickle.dumps(snap)
        assert len(blob) < 4096 and b"Filler" not in blob and b"BulletPoints" not in blob
        env.step("click[back to search]")
        other.reset(seed=99)
        obs, info2 = other.restore(pickle.loads(blob))
        assert obs == obs_then and other.unwrapped.state == state_then
        assert other.unwrapped.state is not None and info2["goal_index"] == info["goal_index"]


def test_corrupt_and_foreign_snapshots_are_refused(data_dir):
    env = WebShopEnv()
    env.reset(seed=0)
    with pytest.raises(SnapshotCorruptError):
        env._set_state(env.state._replace(item=10**9, page="item"))
    with pytest.raises(SnapshotCorruptError):
        env._set_state(("not", "a", "state"))
    foreign = fixture_env(data_dir)
    with foreign.snapshot() as snap, pytest.raises(SnapshotMismatchError, match="differ"):
        env.restore(snap)


# ------------------------------------------------------------------ data loading


def test_missing_and_malformed_data_are_typed_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="does not exist"):
        WebShopEnv(data_dir=str(tmp_path / "nope"))
    monkeypatch.setenv("BRANCHGYM_WEBSHOP_DATA", str(tmp_path))
    with pytest.raises(DataError, match=r"not a complete WebShop data folder"):
        WebShopEnv()
    monkeypatch.delenv("BRANCHGYM_WEBSHOP_DATA")
    d = webshop_data.write_catalog(tmp_path / "a")
    (d / "items_human_ins.json").unlink()
    with pytest.raises(DataError, match="items_human_ins.json"):
        load_catalog(d)
    d = webshop_data.write_catalog(tmp_path / "b")
    (d / "items_shuffle_1000.json").write_text('[{"asin": "B0", "name"')
    with pytest.raises(DataError, match="not valid JSON"):
        load_catalog(d)
    (d / "items_shuffle_1000.json").write_text('{"asin": "B0"}')
    with pytest.raises(DataError, match="expected a list of products"):
        load_catalog(d)
    (d / "items_shuffle_1000.json").write_text(json.dumps([{"asin": "B0X", "name": "x"}]))
    with pytest.raises(DataError, match="product #0: missing category, query"):
        load_catalog(d)
    bad = dict(webshop_data.PRODUCTS[0], pricing="twelve dollars")
    (d / "items_shuffle_1000.json").write_text(json.dumps([bad]))
    with pytest.raises(DataError, match="no '\\$' price"):
        load_catalog(d)
    (d / "items_shuffle_1000.json").write_text("[]")
    with pytest.raises(DataError, match="holds no usable product"):
        load_catalog(d)
    (d / "items_shuffle_1000.json").rename(d / "items_shuffle_a.json")
    (d / "items_shuffle_b.json").write_text("[]")
    with pytest.raises(DataError, match="several WebShop data files.*products_file="):
        load_catalog(d)


def test_real_data_via_environment_variable(data_dir, monkeypatch):
    monkeypatch.setenv("BRANCHGYM_WEBSHOP_DATA", data_dir)
    env = gym.make("branchgym/WebShop-v0", split="all")
    assert env.unwrapped.catalog.source == data_dir and len(env.unwrapped.catalog) == 13
    p = env.unwrapped.catalog.products[0]
    assert p["query"] == "shampoo" and p["options"]["scent"] == ["tea tree", "lavender | mint"]
    assert p["Reviews"][0] == {"title": "Great", "score": "5", "body": "Smells nice."}


def test_parse_pricing_like_upstream():
    assert parse_pricing("$12.99") == [12.99]
    assert parse_pricing("$1,299.00 - $1,499.50") == [1299.0, 1499.5]
    assert parse_pricing("") == [100.0] and parse_pricing(None) == [100.0]
    assert parse_pricing("$5$6$7") == [5.0, 6.0]


def test_generator_is_deterministic_and_covers_the_categories(tmp_path):
    a = write_catalog(tmp_path / "a", n_products=120, seed=3)
    b = write_catalog(tmp_path / "b", n_products=120, seed=3)
    c = write_catalog(tmp_path / "c", n_products=120, seed=4)
    names = ["items_shuffle.json", "items_ins_v2.json", "items_human_ins.json", "reviews.json"]

    def digest(d):
        return [hashlib.sha256((d / n).read_bytes()).hexdigest() for n in names]

    assert digest(a) == digest(b) != digest(c)
    products = json.loads((a / "items_shuffle.json").read_text())
    assert len({p["query"] for p in products}) == len(KINDS) >= 15
    assert {p["category"] for p in products} == {
        "beauty",
        "food",
        "fashion",
        "furniture",
        "electronics",
    }
    human = json.loads((a / "items_human_ins.json").read_text())
    ins = human[products[0]["asin"]][0]
    assert set(ins) >= {"instruction", "instruction_attributes", "instruction_options"}
    assert all(
        o in json.dumps(products[0]["customization_options"]) for o in ins["instruction_options"]
    )


# ----------------------------------------------------------------------- search


def test_analyzer_is_lucene_like():
    assert analyze("The Runner's SHOES, and 6.76 fl.oz of l'eau") == [
        "runner",
        "shoe",
        "6.76",
        "fl.oz",
        "l'eau",
    ]
    assert "the" in LUCENE_STOPWORDS and "i" not in LUCENE_STOPWORDS


def test_search_ranking_ties_and_cache(data_dir, tmp_path, monkeypatch):
    cat = load_catalog(data_dir)
    idx = cat.index
    hits = idx.search("filler shampoo")
    names = [cat.products[i]["asin"] for i in hits]
    # the ten fillers tie on "filler shampoo": catalog order breaks the tie
    assert names[:10] == [f"B000FILL{i:02d}" for i in range(1, 11)]
    assert idx.search("zzzz unknown") == () and idx.search("the and of") == ()
    assert len(idx.search("shampoo", k=5)) == 5
    again = SearchIndex.for_catalog(cat)  # loaded from the disk cache
    assert again.search("filler shampoo") == hits


def test_repeated_query_terms_weigh_by_count(data_dir):
    idx = load_catalog(data_dir).index
    once, twice = idx.scores("acme"), idx.scores("acme acme")
    assert (twice == 2 * once).all() and once.max() > 0


def test_top_50_cap():
    cat = load_catalog()
    hits = cat.index.search("hoodie shoes shampoo coffee rug chair")
    assert len(hits) == 50 and len(set(hits)) == 50


# ----------------------------------------------------------------------- expert


def test_scripted_expert_solves_test_goals():
    env = gym.make("branchgym/WebShop-v0", split="test")
    res = run_expert(env, range(0, 500, 5))  # every fifth test goal: a CI-sized sample
    assert res.mean >= 0.7, res.mean
    assert max(res.steps) <= 8 and res.success_rate > 0.4


# -------------------------------------------------------------------------- CLI


def test_play_lets_a_person_shop():
    env = gym.make("branchgym/WebShop-v0")
    _, info = env.reset(seed=0)
    search = info["admissible_actions"][0]
    script = f"{search}\n:snap\nclick[nope]\n:actions\n:restore 0\n:history\n:quit\n"
    out = io.StringIO()
    assert play("branchgym/WebShop-v0", stdin=io.StringIO(script), stdout=out) == 0
    text = out.getvalue()
    assert "WebShop [SEP] Instruction: [SEP]" in text and "Page 1 (Total results: 50)" in text
    assert "snapshot 0 at step 1 (state," in text
    assert "Invalid action 'click[nope]'" in text and "click[back to search]" in text
    assert "restored snapshot 0 (step 1)" in text and f"actions: {search}" in text


def test_registered_with_its_extra():
    spec = branchgym.branch_spec("branchgym/WebShop-v0")
    assert spec.missing() == [] and ("Stemmer", "webshop") in spec.requires


def test_snapshots_travel_between_copies_of_the_data(data_dir, tmp_path):
    """The catalog's identity is its content, not its path or file times."""
    import shutil

    from branchgym.envs.webshop.data import clear_catalog_cache

    copy = shutil.copytree(data_dir, tmp_path / "copy")
    a, b = fixture_env(data_dir), fixture_env(str(copy))
    assert a.catalog is not b.catalog and a.catalog.fingerprint == b.catalog.fingerprint
    a.step("search[acme]")
    with a.snapshot() as snap:
        assert b.restore(pickle.loads(pickle.dumps(snap)))[0] == a._obs
    clear_catalog_cache()
    assert load_catalog(data_dir) is not a.catalog
