"""Golden WebShop pages: exact observation strings of every page type, in every mode."""

import pytest

from branchgym.envs.webshop import WebShopEnv
from tests.envs.webshop.webshop_data import write_catalog

INS = "i need a sulfate free tea tree shampoo in 16 fl oz, and price lower than 40.00 dollars"
HEAD = f"Instruction: [SEP] {INS} [SEP] Back to Search"
FILLERS = " [SEP] ".join(
    f"B000FILL{i:02d} [SEP] Filler Shampoo Number {i} [SEP] ${i}.5" for i in range(1, 9)
)
RESULTS_1 = (
    f"{HEAD} [SEP] Page 1 (Total results: 12) [SEP] Next > [SEP] B000TEST01 [SEP] Acme Tea "
    "Tree Shampoo, Sulfate Free [SEP] $12.99 [SEP] B000TEST03 [SEP] Acme Daily Shampoo [SEP] "
    f"$100.0 [SEP] {FILLERS}"
)
RESULTS_2 = (
    f"{HEAD} [SEP] Page 2 (Total results: 12) [SEP] < Prev [SEP] Next > [SEP] B000FILL09 [SEP] "
    "Filler Shampoo Number 9 [SEP] $9.5 [SEP] B000FILL10 [SEP] Filler Shampoo Number 10 [SEP] "
    "$10.5"
)
ITEM = (
    f"{HEAD} [SEP] < Prev [SEP] size [SEP] 8 fl oz [SEP] 16 fl oz [SEP] scent [SEP] tea tree "
    "[SEP] lavender | mint [SEP] Acme Tea Tree Shampoo, Sulfate Free [SEP] Price: $12.99 [SEP] "
    "Rating: 4.5 [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now"
)
DONE = (
    "Thank you for shopping with us! [SEP] Your code: [SEP] None [SEP] (Paste it in your MTurk "
    'interface.) [SEP] Purchased [SEP] asin [SEP] B000TEST01 [SEP] options [SEP] {{"scent": '
    '"tea tree", "size": "16 fl oz"}} [SEP] attrs [SEP] None [SEP] category [SEP] None [SEP] '
    "query [SEP] None [SEP] product category [SEP] None [SEP] Target [SEP] asin [SEP] options "
    "[SEP] attrs [SEP] price upper [SEP] instuction text [SEP] category [SEP] product category "
    "[SEP] query [SEP] Goal [SEP] None [SEP] Reward [SEP] Your score (min 0.0, max 1.0) [SEP] "
    "{reward} [SEP] Reward Details [SEP] None"
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(write_catalog(tmp_path_factory.mktemp("webshop")))


def make(data_dir, **kw):
    env = WebShopEnv(data_dir=data_dir, split="all", max_steps=40, **kw)
    obs, info = env.reset(options={"goal_index": 1})
    return env, obs, info


def test_search_page(data_dir):
    env, obs, info = make(data_dir)
    assert obs == f"WebShop [SEP] Instruction: [SEP] {INS} [SEP] Search"
    assert info["available_actions"] == {"has_search_bar": True, "clickables": ["search"]}
    assert info["admissible_actions"] == [f"search[{INS}]"]


def test_results_pages_and_pagination(data_dir):
    env, *_ = make(data_dir)
    obs, r, term, trunc, info = env.step("search[Acme Tea Tree Shampoo]")
    assert obs == RESULTS_1 and (r, term, trunc) == (0.0, False, False)
    assert info["admissible_actions"][:3] == [
        "click[back to search]",
        "click[next >]",
        "click[b000test01]",
    ]
    assert len(info["admissible_actions"]) == 12
    assert env.step("click[next >]")[0] == RESULTS_2
    assert env.step("click[< prev]")[0] == RESULTS_1
    env.step("click[next >]")
    empty = env.step("click[next >]")[0]  # Next > is shown even past the last result
    assert empty == f"{HEAD} [SEP] Page 3 (Total results: 12) [SEP] < Prev [SEP] Next >"


def test_item_page_options_and_sub_pages(data_dir):
    env, *_ = make(data_dir, show_attrs=True)
    env.step("search[acme tea tree shampoo]")
    obs, *_, info = env.step("click[B000TEST01]")  # the argument is lowercased
    assert obs == ITEM.replace("Reviews [SEP] Buy Now", "Reviews [SEP] Attributes [SEP] Buy Now")
    assert info["available_actions"]["clickables"] == [
        "back to search",
        "< prev",
        "description",
        "features",
        "reviews",
        "attributes",
        "buy now",
        "8 fl oz",
        "16 fl oz",
        "tea tree",
        "lavender | mint",  # "Lavender/Mint" as upstream loads it
    ]
    sub = f"{HEAD} [SEP] < Prev [SEP] "
    assert env.step("click[description]")[0] == sub + "A gentle shampoo with tea tree oil."
    assert env.step("click[< prev]")[0].startswith(f"{HEAD} [SEP] < Prev [SEP] size")
    assert env.step("click[features]")[0] == (
        sub + "Sulfate free formula [SEP] Made with natural ingredients"
    )
    env.step("click[< prev]")
    assert env.step("click[reviews]")[0] == (
        sub + '"Great" [SEP] 5 [SEP] Smells nice. [SEP] "Okay" [SEP] 4 [SEP] Fine.'
    )
    env.step("click[< prev]")
    assert env.step("click[attributes]")[0] == (
        sub + "sulfate free [SEP] tea tree [SEP] beauty [SEP] shampoo [SEP] Beauty & Personal "
        "Care › Hair Care › Shampoos"
    )


def test_empty_sub_pages_and_missing_price(data_dir):
    env, *_ = make(data_dir)
    env.step("search[acme daily]")
    obs = env.step("click[b000test03]")[0]
    assert "Acme Daily Shampoo [SEP] Price: $100.0 [SEP] Rating: N.A. [SEP] Description" in obs
    assert env.step("click[reviews]")[0] == f"{HEAD} [SEP] < Prev"
    env.step("click[< prev]")
    env.step("search[bolt running shoes]")
    env.step("click[b000test02]")
    assert env.step("click[description]")[0] == f"{HEAD} [SEP] < Prev"  # empty description
    env.step("click[< prev]")
    assert env.step("click[features]")[0] == f"{HEAD} [SEP] < Prev [SEP] Lightweight mesh"


def test_price_range_display(data_dir):
    env, *_ = make(data_dir)
    obs = env.step("search[bolt running shoes]")[0]
    assert "B000TEST02 [SEP] Bolt Running Shoes [SEP] $45.0 to $60.0" in obs


def test_done_page_and_reward(data_dir):
    env, *_ = make(data_dir)
    env.step("search[acme tea tree shampoo]")
    env.step("click[b000test01]")
    env.step("click[16 fl oz]")
    env.step("click[tea tree]")
    obs, reward, term, trunc, info = env.step("click[buy now]")
    assert (reward, term, trunc) == (1.0, True, False)
    assert obs == DONE.format(reward="1.0")
    assert info["admissible_actions"] == [] and info["available_actions"]["clickables"] == []
    assert info["reward_info"]["r_option"] == 1.0
    assert info["purchased"] == {
        "asin": "B000TEST01",
        "options": {"size": "16 fl oz", "scent": "tea tree"},
        "price": 12.99,
    }


def test_text_rich_marks_buttons_and_clicked_items(data_dir):
    env, *_ = make(data_dir, observation_mode="text_rich")
    env.step("search[acme tea tree shampoo]")
    env.step("click[b000test01]")
    env.step("click[16 fl oz]")
    obs = env.step("click[lavender | mint]")[0]
    assert obs == (
        "You have clicked lavender | mint.\nYou have clicked 16 fl oz.\n"
        f"Instruction:\n{INS}\n[button] Back to Search [button_]\n[button] < Prev [button_]\n"
        "size\n  [button] 8 fl oz [button_]\n  [clicked button] 16 fl oz [clicked button_]\n"
        "scent\n  [button] tea tree [button_]\n"
        "  [clicked button] lavender | mint [clicked button_]\n"
        "Acme Tea Tree Shampoo, Sulfate Free\nPrice: $12.99\nRating: 4.5\n"
        "[button] Description [button_]\n[button] Features [button_]\n"
        "[button] Reviews [button_]\n[button] Buy Now [button_]\n"
    )
    obs = env.step("click[< prev]")[0]
    assert obs.startswith(
        f"Instruction:\n{INS}\n[button] Back to Search [button_]\nPage 1 (Total results: 12)\n"
        "[button] Next > [button_]\n\n[clicked button] B000TEST01 [clicked button_]\n"
        "Acme Tea Tree Shampoo, Sulfate Free\n$12.99\n\n[button] B000TEST03 [button_]\n"
    )


def test_html_mode_has_upstream_hooks(data_dir):
    env, obs, _ = make(data_dir, observation_mode="html")
    assert '<input id="search_input"' in obs and f"Instruction:<br>{INS}" in obs
    env.step("search[acme tea tree shampoo]")
    obs = env.step("click[b000test01]")[0]
    assert '<input type="radio" name="scent" value="lavender | mint">' in obs
    assert '<button type="submit" class="btn btn-primary">Buy Now</button>' in obs
    assert '<a class="product-link">B000TEST01</a>' in env.step("click[< prev]")[0]
    assert "&lt; Prev" in env.step("click[next >]")[0]


def test_invalid_action_feedback_keeps_the_page(data_dir):
    env, *_ = make(data_dir)
    env.step("search[acme tea tree shampoo]")
    before = env.state
    obs, r, term, trunc, info = env.step("click[buy now]")
    assert obs == (
        "Invalid action 'click[buy now]': 'buy now' is not clickable on this page; nothing "
        f"happened. [SEP] {RESULTS_1}"
    )
    assert (r, term, trunc, info["invalid_action"]) == (0.0, False, False, True)
    assert env.state._replace(step=1, history=(), message=None) == before._replace(history=())
    obs = env.step("click[next >]")[0]  # the next valid action clears the message
    assert obs == RESULTS_2
