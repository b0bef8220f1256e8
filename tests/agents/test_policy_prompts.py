"""Policies' reported log-probs/entropies, and the per-env prompt builders and parsers."""

import math

import numpy as np
import pytest

from branchgym.agents.policies.policy import (
    ActRequest,
    Context,
    Policy,
    ScriptedPolicy,
    TabularPolicy,
    TextPolicy,
    Turn,
    sequence_distribution,
)
from branchgym.agents.policies.prompts import (
    ALFWorldPrompt,
    PromptBuilder,
    SWEBenchPrompt,
    TextTreePrompt,
    WebShopPrompt,
    prompt_for,
)

MAZE = ["go north", "go east", "go south", "go west"]


def ctx(info=None, env_id="branchgym/TextTreeMDP-v0", obs="room 0"):
    return Context(env_id, obs, info if info is not None else {"admissible_actions": MAZE})


def test_policies_satisfy_the_protocol():
    for p in (TabularPolicy([0.5, 0.5]), TextPolicy(), ScriptedPolicy(["a"])):
        assert isinstance(p, Policy)


def test_tabular_policy_samples_its_table():
    table = np.array([[0.7, 0.2, 0.1], [0.0, 0.0, 1.0]])
    pol = TabularPolicy(table, ["a", "b", "c"])
    rng = np.random.default_rng(0)
    (samples,) = pol.act([ActRequest(ctx({"node": 0}), n=4000)], rng)
    freq = np.bincount([int(s.token_ids[0]) for s in samples], minlength=3) / 4000
    np.testing.assert_allclose(freq, table[0], atol=0.03)
    h = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1))
    for s in samples[:20]:
        a = int(s.token_ids[0])
        assert s.action == "abc"[a] and s.logprobs[0] == pytest.approx(math.log(table[0, a]))
        assert s.entropies[0] == pytest.approx(h)
    (s,) = pol.act([ActRequest(ctx({"node": 1}))], rng)[0]
    assert s.action == "c" and s.entropies[0] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="probabilities"):
        TabularPolicy([[0.5, 0.6]])


def test_text_policy_reports_exact_per_byte_distribution():
    pol = TextPolicy()
    (samples,) = pol.act([ActRequest(ctx(), n=400)], np.random.default_rng(1))
    assert {s.action for s in samples} == set(MAZE)
    for s in samples[:8]:
        assert s.logprobs.sum() == pytest.approx(math.log(1 / 4), abs=1e-5)
        # "go " is shared (entropy 0), the next byte splits 4 ways, then all is forced
        np.testing.assert_allclose(s.entropies[:3], 0.0, atol=1e-6)
        assert s.entropies[3] == pytest.approx(math.log(4), abs=1e-5)
        np.testing.assert_allclose(s.entropies[4:], 0.0, atol=1e-6)
    # a forced prefix conditions the distribution
    prefix = tuple(b"go s")
    (forced,) = pol.act([ActRequest(ctx(), n=5, prefix_token_ids=prefix)], np.random.default_rng(0))
    assert {s.action for s in forced} == {"go south"} and forced[0].prefix_len == 4


def test_text_policy_weights_and_invalid_text():
    pol = TextPolicy(
        weights=lambda c, cands: [3.0 if a == "go west" else 1.0 for a in cands], invalid_prob=0.2
    )
    (samples,) = pol.act([ActRequest(ctx(), n=3000)], np.random.default_rng(2))
    acts = [s.action for s in samples]
    assert acts.count("dance wildly") / 3000 == pytest.approx(0.2, abs=0.03)
    assert acts.count("go west") / 3000 == pytest.approx(0.8 * 0.5, abs=0.03)
    bad = next(s for s in samples if s.action == "dance wildly")
    assert bad.parse_error and bad.logprobs.sum() == pytest.approx(math.log(0.2), abs=1e-5)
    with pytest.raises(ValueError, match="no candidates"):
        TextPolicy().act([ActRequest(ctx({}))], np.random.default_rng(0))


def test_sequence_distribution_handles_shared_prefixes():
    seqs = [(1, 2, 9), (1, 3, 9), (4, 9)]
    lp, ent = sequence_distribution(seqs, [0.25, 0.25, 0.5], 1)
    np.testing.assert_allclose(np.exp(lp), [0.5, 0.5, 1.0], rtol=1e-6)
    np.testing.assert_allclose(ent, [math.log(2), math.log(2), 0.0], atol=1e-6)
    lp, _ = sequence_distribution(seqs, [0.25, 0.25, 0.5], 1, prefix_len=1)
    np.testing.assert_allclose(np.exp(lp), [1.0, 0.5, 1.0], rtol=1e-6)


def test_scripted_policy_plays_its_script():
    pol = ScriptedPolicy(["go east", "go west"])
    c = ctx()
    t = Turn("go east", (1,), "go east", "room 1", {})
    acts = [
        pol.act([ActRequest(x)], None)[0][0].action for x in (c, c.extend(t), c.extend(t).extend(t))
    ]
    assert acts == ["go east", "go west", "go west"]


# --------------------------------------------------------------------------- prompts


def test_react_parsing_and_admissible_matching():
    p = TextTreePrompt()
    info = {"admissible_actions": MAZE}
    assert p.parse("Thought: east.\nAction: Go  East.", info).action == "go east"
    assert p.parse("Action: go up\nAction: go west", info).action == "go west"  # the last one
    bad = p.parse("Thought: hmm\nAction: fly away", info)
    assert not bad.valid and bad.action == "fly away" and "admissible" in bad.error
    assert p.parse("go north", info).action == "go north"  # bare reply: last line
    assert not p.parse("   ", info).valid
    msgs = p.messages(ctx().extend(Turn("Action: go east", (), "go east", "room 2", {})))
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert "Available actions: go north" in msgs[1]["content"]
    assert msgs[3]["content"].startswith("Observation: room 2")


def test_webshop_grammar_and_sep_pages():
    p = WebShopPrompt()
    page = "Back to Search [SEP] Page 1 [SEP] B07XYZ [SEP] Red Shirt [SEP] $15"
    info = {"admissible_actions": ["search[<query>]", "click[Back to Search]", "click[B07XYZ]"]}
    text = p.render_observation(page, info)
    assert text.splitlines()[:4] == ["Back to Search", "Page 1", "B07XYZ", "Red Shirt"]
    assert p.parse("Action: search[red cotton shirt]", info) == p.check(
        "search[red cotton shirt]", info
    )
    assert p.parse("Action: search[red cotton shirt]", info).valid
    assert p.parse("Action: click[b07xyz]", info).action == "click[B07XYZ]"
    assert (
        p.parse("Thought: buy\nAction: Click[ back to search ]", info).action
        == "click[Back to Search]"
    )
    miss = p.parse("Action: click[Buy Now]", info)
    assert not miss.valid and "nothing clickable" in miss.error
    assert not p.parse("Action: buy the shirt", info).valid
    assert not p.parse("Action: search[]", info).valid
    no_bar = {"admissible_actions": ["click[Buy Now]"]}
    assert not p.parse("Action: search[shirt]", no_bar).valid
    assert p.parse("Action: click[Buy Now]", no_bar).valid
    assert p.parse("Action: click[anything]", {}).valid  # no list: grammar only


def test_alfworld_commands():
    p = ALFWorldPrompt()
    info = {"admissible_commands": ["go to countertop 1", "take mug 1 from countertop 1", "look"]}
    assert p.parse("Thought: grab it\nAction: > take mug 1 from countertop 1", info).action == (
        "take mug 1 from countertop 1"
    )
    assert p.parse("Action: Go to Countertop 1.", info).action == "go to countertop 1"
    bad = p.parse("Action: take mug 2 from countertop 1", info)
    assert not bad.valid and bad.action == "take mug 2 from countertop 1"  # env: "Nothing happens."
    assert "countertop 1" in p.render_observation("You see a countertop 1.", info)


def test_swebench_commands_and_submit():
    p = SWEBenchPrompt()
    reply = "Thought: look\n```bash\ngrep -rn 'def parse' src/\n```\nthen\n```bash\nls -la\n```"
    assert p.parse(reply).action == "ls -la"
    assert p.parse("```\npython -m pytest -q tests/test_x.py\n```").action.startswith(
        "python -m pytest"
    )
    assert p.parse("Thought: done.\nAction: submit").action == "submit"
    assert p.parse("```bash\nSUBMIT\n```").action == "submit"
    assert p.parse("Action: $ cat setup.py").action == "cat setup.py"
    assert not p.parse("```bash\n\n```").valid
    multi = p.parse("```bash\ncd src && \\\n  sed -i 's/a/b/' x.py\n```").action
    assert multi.startswith("cd src") and "sed -i" in multi


def test_prompt_for_picks_by_env_id():
    assert isinstance(prompt_for("branchgym/WebShop-v0"), WebShopPrompt)
    assert isinstance(prompt_for("branchgym/ALFWorld-v0"), ALFWorldPrompt)
    assert isinstance(prompt_for("branchgym/SWEBench-v0"), SWEBenchPrompt)
    assert isinstance(prompt_for("branchgym/TextTreeMDP-v0"), TextTreePrompt)
    assert isinstance(prompt_for("mypkg:branchgym/WebShop-v1"), WebShopPrompt)
    assert type(prompt_for("other/Env-v0")) is PromptBuilder
