"""Attribution by forking, validated where the truth is known."""

import json

import gymnasium as gym
import numpy as np
import pytest

import branchgym
from branchgym.error import FidelityViolation
from branchgym.evaluation.agents import Agent, make_agent
from branchgym.evaluation.attribution import action_kind, attribute_episode
from branchgym.evaluation.attribution_run import attribute_run
from branchgym.evaluation.protocols import get_protocol
from branchgym.evaluation.runner import EvalOptions, read_episodes, run_eval
from branchgym.tree_format import load_trees


def test_value_intervals_cover_the_exact_values_on_texttree(tmp_path):
    """The uniform random agent on the CI maze: V^pi(s_t) is exact (backward induction).

    Clopper-Pearson intervals are conservative: at 95 % they cover at least 95 % of the
    time, so over 36 states at least 32 must be covered (failing that has probability
    under 1 % at the nominal rate).
    """
    proto = get_protocol("texttree-ci").resolve(tasks=12)
    run_eval(proto, make_agent("random", proto.env_id), tmp_path, EvalOptions(progress=False))
    attribute_run(tmp_path, forks=30, episodes="all", mode="all", progress=False)
    base = gym.make(proto.env_id, **proto.env_kwargs).unwrapped
    hits = n = 0
    for line in (tmp_path / "attribution.jsonl").read_text().splitlines():
        res = json.loads(line)
        (tree,) = load_trees(tmp_path / "trees" / f"{res['task']}__a0.json.gz")
        nodes = [tree.info["node"]] + [tree[i].info["node"] for i in tree.paths()[0]]
        for v in res["values"]:
            if v["forks"]:
                n += 1
                hits += v["low"] <= base.value(nodes[v["step"]]) <= v["high"]
        if res["success"]:
            assert res["decisive"] is None and "succeeded" in res["statement"]
    assert n == 36 and hits >= 32, (hits, n)
    report = (tmp_path / "attribution.md").read_text()
    assert "forking at every step" in report and (tmp_path / "attribution.png").exists()


def _slip_expert(step: int, p: float):
    """The WebShop shopper, except that at ``step`` it buys at once with probability ``p``.

    Buying before choosing the options the goal names ends the episode below reward 1:
    an unrecoverable mistake, made by chance, as an agent's slips are.
    """
    from branchgym.agents.policies.experts import webshop_expert

    def make(env, rng):
        act = webshop_expert(env, rng)

        def slip(obs, info):
            if int(info.get("step", -1)) == step and rng.random() < p:
                return "click[buy now]"
            return act(obs, info)

        return slip

    return make


@pytest.mark.slow
def test_attribution_names_the_step_of_a_known_mistake_on_webshop(tmp_path):
    proto = get_protocol("webshop-test").resolve(tasks=60)
    expert = make_agent("expert", proto.env_id)
    run_eval(proto, expert, tmp_path / "expert", EvalOptions(progress=False))
    eps = read_episodes(tmp_path / "expert" / "episodes.jsonl")
    # goals the shopper wins by choosing at least one option at step 2 (an item page)
    ids = [t for (t, _), r in eps.items() if r["success"] and len(r["actions"]) >= 4
           and r["actions"][2] != "click[buy now]"]  # fmt: skip
    assert len(ids) >= 10
    sub = get_protocol("webshop-test").resolve(tasks=ids)
    slip = Agent("slip", "expert", None, _slip_expert(2, 0.5), {"kind": "slip"})
    run_eval(sub, slip, tmp_path / "slip", EvalOptions(episodes_per_task=2, progress=False))
    report = attribute_run(tmp_path / "slip", forks=20, episodes="all", agent=slip,
                           progress=False)  # fmt: skip
    results = [json.loads(x) for x in (tmp_path / "slip" / "attribution.jsonl").open()]
    failed = [r for r in results if not r["success"]]
    won = [r for r in results if r["success"]]
    assert len(failed) >= 5 and won
    named = sum(1 for r in failed if r["decisive"] == 2)
    assert named >= 0.9 * len(failed), [r["statement"] for r in failed]
    assert all(r["action"]["kind"] == "purchase" for r in failed if r["decisive"] == 2)
    assert all(r["decisive"] is None for r in won)
    # bisection forks at about log2(T) states instead of T
    assert report["cost"]["forks"] < report["naive_cost"]["forks"]
    assert report["by_kind"].get("purchase", 0) == named


@pytest.mark.slow
def test_attribution_names_the_step_of_a_known_mistake_on_alfworld(tmp_path):
    """The planner goes to a wrong place at step 2 with probability 0.5.

    No ALFWorld action is irreversible, so the step cap is set to the planner's own episode
    length on each game: the wasted step is what loses the episode.
    """
    from branchgym.bench.eval_states import mistaken_expert

    proto = get_protocol("alfworld-thor-unseen")
    every = proto.resolve().tasks
    spread = proto.resolve(tasks=[t.id for t in every[:: len(every) // 32]])  # all task types
    run_eval(spread, make_agent("expert", spread.env_id), tmp_path / "expert",
             EvalOptions(progress=False))  # fmt: skip
    caps: dict[int, list[str]] = {}
    short = 0  # the games the planner wins in at most 5 steps: forks from each state are cheap
    for (task, _), rec in read_episodes(tmp_path / "expert" / "episodes.jsonl").items():
        assert rec["success"]
        if len(rec["actions"]) <= 5 and short < 12:
            caps.setdefault(len(rec["actions"]), []).append(task)
            short += 1
    assert short == 12
    slip = Agent("slip", "expert", None, mistaken_expert(spread.env_id, 2, 0.5), {"kind": "slip"})
    results = []
    for cap, tasks in caps.items():
        run = tmp_path / f"cap{cap}"
        run_eval(proto.resolve(tasks=tasks, max_steps=cap), slip, run,
                 EvalOptions(episodes_per_task=2, progress=False))  # fmt: skip
        attribute_run(run, forks=24, episodes="all", agent=slip, progress=False)
        results += [json.loads(x) for x in (run / "attribution.jsonl").open()]
    failed = [r for r in results if not r["success"]]
    won = [r for r in results if r["success"]]
    assert len(failed) >= 8 and won
    named = [r for r in failed if r["decisive"] == 2]
    assert len(named) >= 0.9 * len(failed), [r["statement"] for r in failed]
    assert all(r["action"]["kind"] == "navigation" for r in named)
    assert all(r["decisive"] is None for r in won)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["webshop-test", "alfworld-thor-unseen"])
def test_a_correct_expert_episode_has_no_decisive_step(tmp_path, protocol):
    proto = get_protocol(protocol).resolve(tasks=8)
    expert = make_agent("expert", proto.env_id)
    run_eval(proto, expert, tmp_path, EvalOptions(progress=False))
    won = [r for r in read_episodes(tmp_path / "episodes.jsonl").values() if r["success"]][:2]
    assert won
    make_env = branchgym.rollout.executor_base.EnvRecipe(proto.env_id, proto.env_kwargs).make
    tasks = {t.id: t for t in proto.tasks}
    for rec in won:
        (tree,) = load_trees(tmp_path / rec["tree"])
        res = attribute_episode(tree, expert, make_env, options=tasks[rec["task"]].options,
                                max_steps=proto.max_steps, forks=4, mode="all")  # fmt: skip
        assert res.decisive is None
        assert all(v.value == 1.0 for v in res.values)  # the planner wins from every state


def test_an_unfaithful_sandbox_is_refused_before_any_fork(tmp_path):
    from branchgym.scenarios.faults import RestoreFault

    proto = get_protocol("texttree-ci").resolve(tasks=3)
    run_eval(proto, make_agent("random", proto.env_id), tmp_path, EvalOptions(progress=False))

    def broken():
        return RestoreFault(gym.make(proto.env_id, **proto.env_kwargs), rate=1.0, seed=0)

    with pytest.raises(FidelityViolation, match="cannot be trusted"):
        attribute_run(tmp_path, forks=4, episodes="all", make_env=broken, progress=False)
    assert not (tmp_path / "attribution.jsonl").exists()


def test_a_run_of_predictions_has_no_agent_to_fork(tmp_path):
    from branchgym.error import OptionError
    from branchgym.evaluation.attribution_run import agent_from_run

    doc = {"agent": {"spec": "gold", "config": {"kind": "gold"}},
           "protocol": {"env_id": "branchgym/SWEBench-v0"}}  # fmt: skip
    with pytest.raises(OptionError, match="no agent to fork"):
        agent_from_run(doc)


@pytest.mark.parametrize(
    ("env_id", "action", "kind"),
    [
        ("branchgym/WebShop-v0", "search[red shoes]", "search"),
        ("branchgym/WebShop-v0", "click[b07xyz1234]", "product choice"),
        ("branchgym/WebShop-v0", "click[size 9]", "option"),
        ("branchgym/WebShop-v0", "click[buy now]", "purchase"),
        ("branchgym/WebShop-v0", "click[< prev]", "navigation"),
        ("branchgym/ALFWorld-v0", "go to cabinet 1", "navigation"),
        ("branchgym/ALFWorld-v0", "take mug 1 from countertop 1", "pick up"),
        ("branchgym/ALFWorld-v0", "heat mug 1 with microwave 1", "heat/cool/clean/use"),
        ("branchgym/SWEBench-v0", "grep -rn foo .", "grep"),
        ("branchgym/SWEBench-v0", "submit", "submit"),
    ],
)
def test_action_kinds(env_id, action, kind):
    assert action_kind(env_id, action) == kind


def test_forks_reseed_a_stochastic_env(tmp_path):
    """Siblings restored from one snapshot draw their own transitions (not one shared draw)."""
    proto = get_protocol("texttree-ci").resolve(tasks=1)
    run_eval(proto, make_agent("random", proto.env_id), tmp_path, EvalOptions(progress=False))
    rec = next(iter(read_episodes(tmp_path / "episodes.jsonl").values()))
    (tree,) = load_trees(tmp_path / rec["tree"])
    make_env = branchgym.rollout.executor_base.EnvRecipe(proto.env_id, proto.env_kwargs).make
    res = attribute_episode(tree, make_agent("random", proto.env_id), make_env,
                            max_steps=proto.max_steps, forks=40, mode="all")  # fmt: skip
    first = res.values[0]
    assert 0 < first.successes < first.forks  # a shared draw would give all or none
    assert np.isclose(first.value, first.successes / 40)


def test_compare_from_states_pairs_two_agents_on_the_same_snapshots(tmp_path, capsys):
    from branchgym.cli import main

    base = ["eval", "branchgym/TextTreeMDP-v0", "--tasks", "10", "--no-progress"]
    assert main([*base, "--agent", "expert", "--out", str(tmp_path / "a")]) == 0
    assert main([*base, "--agent", "random", "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    out = tmp_path / "states.json"
    argv = ["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--from-states",
            "--forks", "6", "--depths", "0,0.5", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "paired by state" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["states"] == 20  # 10 episodes x 2 depths (depth 0.5 of 3 steps is step 1)
    d = res["a_minus_b"]
    assert d["mean"] > 0 and d["low"] <= d["mean"] <= d["high"]
    assert d["mean"] == pytest.approx(res["a_from_states"]["mean"] - res["b_from_states"]["mean"])
    assert res["env_steps"]["a"] > 0 and res["env_steps"]["b"] > 0


def test_attribution_trees_show_forks_as_branches_and_the_value_curve_in_view(tmp_path):
    from branchgym.viewer import render_html, tree_view

    proto = get_protocol("texttree-ci").resolve(tasks=6)
    run_eval(proto, make_agent("random", proto.env_id), tmp_path, EvalOptions(progress=False))
    attribute_run(tmp_path, forks=6, episodes="all", mode="all", progress=False)
    files = sorted((tmp_path / "attribution").glob("*.json.gz"))
    assert len(files) == 6
    (tree,) = load_trees(files[0])
    view = tree_view(tree)
    att = view["attribution"]
    assert [v[0] for v in att["values"]] == list(range(len(tree.backbone) + 1))
    # every measured state is a branch point with its 6 forks beside the episode's action
    assert len(view["branch_points"]) == len(tree.backbone)
    assert all(b["k"] == 7 for b in view["branch_points"])
    backbone_adv = [n["advantage"] for n in view["nodes"] if n["backbone"]]
    values = [v[1] for v in att["values"]]
    assert backbone_adv == pytest.approx([b - a for a, b in zip(values, values[1:], strict=False)])
    assert "valueCurve" in render_html(files[0])


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_forks_through_an_executor_equal_the_in_process_forks(tmp_path, executor, capsys):
    """The episode's states live in the executor's workers; the forks are the same."""
    from branchgym.cli import main
    from branchgym.error import OptionError

    proto = get_protocol("texttree-ci").resolve(tasks=5)
    run_eval(proto, make_agent("random", proto.env_id), tmp_path, EvalOptions(progress=False))
    attribute_run(tmp_path, forks=6, episodes="all", mode="all", progress=False)
    local = [json.loads(x) for x in (tmp_path / "attribution.jsonl").open()]
    assert main(["eval", "attribute", str(tmp_path), "--forks", "6", "--episodes", "all",
                 "--mode", "all", "--executor", executor, "--no-progress",
                 "--executor-options", '{"n_workers": 2}'])  == 0  # fmt: skip
    remote = [json.loads(x) for x in (tmp_path / "attribution.jsonl").open()]
    assert [r["values"] for r in remote] == [r["values"] for r in local]
    assert [r["decisive"] for r in remote] == [r["decisive"] for r in local]
    # every step forked (mode all), plus the replications of decisive steps
    assert sum(v["forks"] for r in remote for v in r["values"]) >= 6 * sum(
        r["length"] for r in local
    )
    capsys.readouterr()
    expert_run = tmp_path / "expert"
    run_eval(proto, make_agent("expert", proto.env_id), expert_run, EvalOptions(progress=False))
    with pytest.raises(OptionError, match="forks run in-process"):
        attribute_run(expert_run, forks=2, episodes="all", executor=executor, progress=False)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_compare_from_states_through_an_executor_equals_in_process(tmp_path, executor):
    from branchgym.error import OptionError
    from branchgym.evaluation.from_states import compare_from_states

    proto = get_protocol("texttree-ci").resolve(tasks=6)
    a, b = tmp_path / "a", tmp_path / "b"
    for seed, run in enumerate((a, b)):
        run_eval(proto, make_agent("random", proto.env_id), run,
                 EvalOptions(progress=False, seed=seed))  # fmt: skip
    local = compare_from_states(a, b, forks=5, progress=False)
    remote = compare_from_states(a, b, forks=5, progress=False, executor=executor,
                                 executor_options={"n_workers": 2})  # fmt: skip
    assert remote == local and local["states"] == 12
    run_eval(proto, make_agent("expert", proto.env_id), tmp_path / "expert",
             EvalOptions(progress=False))  # fmt: skip
    with pytest.raises(OptionError, match="forks run in-process"):
        compare_from_states(tmp_path / "expert", a, forks=2, progress=False, executor=executor)


@pytest.mark.slow
def test_attribution_and_from_states_over_ray_and_served_envs(tmp_path):
    """Ray actors and `branchgym serve` processes on loopback hold the states; same values."""
    pytest.importorskip("ray")
    pytest.importorskip("websockets")
    from branchgym.evaluation.from_states import compare_from_states
    from branchgym.remote import RemoteEnv
    from branchgym.serve.process import ServerProcess

    proto = get_protocol("texttree-ci").resolve(tasks=4)
    for seed, name in enumerate("ab"):
        run_eval(proto, make_agent("random", proto.env_id), tmp_path / name,
                 EvalOptions(progress=False, seed=seed))  # fmt: skip
    attribute_run(tmp_path / "a", forks=4, episodes="all", mode="all", progress=False)
    local = [json.loads(x) for x in (tmp_path / "a" / "attribution.jsonl").open()]
    pair = compare_from_states(tmp_path / "a", tmp_path / "b", forks=4, progress=False)
    servers = [ServerProcess(proto.env_id, proto.env_kwargs).start() for _ in range(2)]
    try:
        for s in servers:
            s.wait_ready()
        for executor, options in (("ray", {"n_workers": 2}),
                                  ("fleet", {"urls": [s.url for s in servers]})):  # fmt: skip
            attribute_run(tmp_path / "a", forks=4, episodes="all", mode="all", progress=False,
                          executor=executor, executor_options=options)  # fmt: skip
            remote = [json.loads(x) for x in (tmp_path / "a" / "attribution.jsonl").open()]
            assert [r["values"] for r in remote] == [r["values"] for r in local], executor
            assert compare_from_states(tmp_path / "a", tmp_path / "b", forks=4, progress=False,
                                       executor=executor, executor_options=options) == pair
        # the states lived on the servers: a snapshot there before every step of every
        # episode, once for the attribution and once for the comparison
        counts = []
        for s in servers:
            env = RemoteEnv(s.url)
            try:
                counts.append(env.stats()["messages"])
            finally:
                env.close()
        snaps = sum(c.get("snapshot", 0) for c in counts)
        assert snaps >= 2 * sum(r["length"] for r in local), counts
    finally:
        for s in servers:
            s.stop()


def test_a_model_run_is_forked_with_the_policy_and_dtype_it_was_played_with():
    from branchgym.evaluation.attribution_run import agent_from_run

    played = make_agent("tiny", "branchgym/TextTreeMDP-v0", max_new_tokens=8,
                        policy="scoring", dtype="bfloat16")  # fmt: skip
    doc = {"agent": {"spec": "tiny", "config": played.config},
           "protocol": {"env_id": "branchgym/TextTreeMDP-v0"}}  # fmt: skip
    again = agent_from_run(doc)
    assert again.config == played.config and again.config_hash == played.config_hash
    old = {"kind": "model", "model": "tiny", "max_new_tokens": 8}  # a run from before --policy
    doc["agent"]["config"] = old
    assert agent_from_run(doc).config["policy"] == "generate"
