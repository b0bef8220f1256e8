"""The branchgym_tree agent loop and the branchgym estimator against the real verl package.

verl's LLM server is replaced by a fake of its async server manager: a real object with
the same ``generate`` coroutine that answers with a ReAct reply naming one of the
admissible actions it reads in the prompt (a deterministic token policy given its seed).
Everything else is verl's own: its registries, AgentLoopBase, its worker's padding and
batching, DataProto, extract_reward and compute_advantage.
"""

import asyncio
import math
import re

import hydra
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    DictConfigWrap,
    _agent_loop_registry,
)
from verl.protocol import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.reward import extract_reward
from verl.workers.rollout.replica import TokenOutput

from branchgym.agents.estimators import advantages
from branchgym.agents.forward.rows import Batch
from branchgym.agents.learners import bpo
from branchgym.agents.policies.models import tiny_tokenizer
from branchgym.error import TrainingConfigError
from branchgym.integrations import verl as bv

M, K = 2, 3
N = 1 + M * (K - 1)


class FakeServerManager:
    """verl's server manager interface: ``await generate(request_id, prompt_ids=..., ...)``."""

    def __init__(self, tokenizer, seed=0):
        self.tok = tokenizer
        self.rng = np.random.default_rng(seed)
        self.requests = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.requests.append((request_id, list(prompt_ids), dict(sampling_params)))
        await asyncio.sleep(0)  # a real await: other coroutines run meanwhile
        text = self.tok.decode(prompt_ids)
        acts = re.findall(r"Available actions: ([^\n<]*)", text)[-1].split(", ")
        choice = acts[int(self.rng.integers(len(acts)))]
        ids = self.tok.encode(f"Action: {choice}", add_special_tokens=False)
        ids.append(self.tok.eos_token_id)
        lp = [-math.log(len(acts))] + [0.0] * (len(ids) - 1)
        return TokenOutput(token_ids=ids, log_probs=lp, stop_reason="completed")


def trainer_config(n=N, response_length=512):
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"prompt_length": 512, "response_length": response_length, "n": n}
            },
            "data": {},
        }
    )


def make_loop(server, tok, cfg=None, **options):
    cfg = cfg or trainer_config()
    # built the way verl's AgentLoopWorker builds any registered loop
    spec = {
        **_agent_loop_registry[bv.AGENT_NAME],
        "m": M,
        "k": K,
        "min_gap": 1,
        "gap_unit": "steps",
        **options,
    }
    return hydra.utils.instantiate(
        config=spec,
        trainer_config=DictConfigWrap(config=cfg),
        server_manager=server,
        tokenizer=tok,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(cfg.data),
    )


ROW = {"extra_info": {"seed": 3, "env_kwargs": {"depth": 3}}, "raw_prompt": [], "index": 0}


def test_registered_in_verls_registries():
    assert _agent_loop_registry[bv.AGENT_NAME]["_target_"].endswith("BranchingAgentLoop")
    assert get_adv_estimator_fn(bv.ESTIMATOR_NAME) is bv.tree_advantage


def grow(**options):
    tok = tiny_tokenizer()
    server = FakeServerManager(tok)
    loop = make_loop(server, tok, **options)

    async def go():
        tree, policy = await loop.grow({"temperature": 1.0, "logprobs": True}, **ROW)
        return tree, policy, loop.outputs(tree, policy)

    tree, policy, outs = asyncio.run(go())
    return tok, server, loop, tree, policy, outs


def test_paths_masks_and_advantages_are_branchgyms():
    tok, server, loop, tree, policy, outs = grow()
    assert len(tree.branch_points()) == M and len(tree.paths()) == N
    assert len(outs) == N
    # every completion came from the server manager, log-probs requested
    assert len(server.requests) == len(tree.nodes)
    assert all(p["logprobs"] is True for _, _, p in server.requests)
    adv, _, _ = advantages.tree_advantages(tree, 0.95, "last")
    rows = {(r.leaf): r for r in Batch([tree]).rows}
    counted = 0
    for out, (path, _) in zip(outs, tree.token_masks(), strict=True):
        mask = np.asarray(out.response_mask)
        a = np.asarray(out.extra_fields[bv.ADVANTAGES_FIELD])
        lp = np.asarray(out.response_logprobs)
        ids = np.asarray(out.response_ids)
        assert len(mask) == len(ids) == len(a) == len(lp)
        row = rows.get(path[-1])
        owned = [d for d in row.decisions] if row else []
        # the counted tokens are exactly the row's owned decision tokens, in order
        np.testing.assert_array_equal(
            ids[mask == 1], np.concatenate([d.token_ids for d in owned]) if owned else []
        )
        want_adv = (
            np.concatenate([np.full(d.n_tokens, adv[d.node]) for d in owned]) if owned else []
        )
        np.testing.assert_allclose(a[mask == 1], want_adv, rtol=0, atol=1e-12)
        np.testing.assert_allclose(
            lp[mask == 1], np.concatenate([d.old_logp for d in owned]) if owned else [], atol=1e-7
        )
        assert not a[mask == 0].any()
        # observation tokens are in the response and never counted
        assert "Observation:" in tok.decode(ids[mask == 0].tolist())
        # the prompt + response is the exact dialogue branchgym's policy conditioned on
        leaf_ctx = bv.Context(tree.env_id, tree.observation, tree.info)
        from branchgym.agents.forward.rows import path_decisions

        last = path_decisions(tree, path, 0)[-1]
        assert out.prompt_ids + out.response_ids == policy.prompt_ids(last.context) + list(
            last.token_ids
        )
        assert out.prompt_ids == policy.prompt_ids(leaf_ctx)
        assert out.reward_score == pytest.approx(float(tree.path_returns_to_go(path)[0]))
        counted += int(mask.sum())
    # a shared prefix is counted once: every generated token exactly once over the paths
    assert counted == tree.generated_tokens()
    figures = outs[0].extra_fields["branchgym_metrics"]
    assert figures["branching/branch_points"] == M
    assert figures["branching/tokens_saved"] == pytest.approx(tree.stats.tokens_saved)
    assert figures["branching/tokens_saved"] > 0


def test_estimator_variant_is_the_registrys():
    opts = {"schedule": "even", "depth_weight": True, "tail": "zero", "lam": 0.9}
    _, _, loop, tree, _, outs = grow(**opts)
    args = bpo.Args(m=M, k=K, **opts)
    want = advantages.advantage("bpo")([tree], advantages.AdvantageOptions.of(args)).nodes[0]
    plain = advantages.tree_advantages(tree, 0.9, "zero")[0]
    assert any(abs(want[i] - plain[i]) > 1e-9 for i in want)  # the variant differs
    for out, (path, masks) in zip(outs, tree.token_masks(), strict=True):
        got = np.asarray(out.extra_fields[bv.ADVANTAGES_FIELD])
        mask = np.asarray(out.response_mask)
        expect = np.concatenate(
            [np.full(int(m.sum()), want[nid]) for nid, m in zip(path, masks, strict=True)]
        )
        np.testing.assert_allclose(got[mask == 1], expect, atol=1e-12)


def test_run_pads_short_trees_and_the_estimator_hands_advantages_on_unchanged():
    tok = tiny_tokenizer()
    server = FakeServerManager(tok, seed=1)
    rows = N + 2
    cfg = trainer_config(n=rows)
    loop = make_loop(server, tok, cfg)
    outs = asyncio.run(loop.run({"temperature": 1.0}, **ROW, branchgym_rows=rows))
    assert len(outs) == rows
    assert [o.extra_fields["branchgym_padding"] for o in outs] == [False] * N + [True] * 2
    assert all(sum(o.response_mask) == 0 for o in outs[N:])

    # verl's worker pads and batches them; the advantages become the token scores
    worker = bv.BranchingAgentLoopWorker.__new__(bv.BranchingAgentLoopWorker)
    worker.rollout_config = cfg.actor_rollout_ref.rollout
    worker.tokenizer, worker.processor = tok, None
    worker.reward_loop_worker_handles, worker.distillation_enabled = None, False
    worker.mm_processor_kwargs = {}
    padded = asyncio.run(worker._agent_loop_postprocess(outs, validate=False, raw_prompt=[]))
    inputs = {"uid": np.array(["p0"], dtype=object), "raw_prompt": np.array([[]], dtype=object)}
    data = worker._postprocess([padded], input_non_tensor_batch=inputs)
    assert len(data) == rows and list(data.non_tensor_batch["uid"]) == ["p0"] * rows
    # the field moved into rm_scores (not duplicated as a non-tensor column)
    assert bv.ADVANTAGES_FIELD not in data.non_tensor_batch
    assert not data.batch["rm_scores"][N:].any()

    # the trainer's own steps: scores -> token_level_rewards -> compute_advantage
    scores, _ = extract_reward(data)
    data.batch["token_level_scores"] = scores
    data.batch["token_level_rewards"] = scores
    before = data.batch["rm_scores"].clone()
    data = compute_advantage(data, adv_estimator=bv.ESTIMATOR_NAME, config=AlgoConfig())
    torch.testing.assert_close(data.batch["advantages"], before, rtol=0, atol=0)
    assert data.batch["advantages"].abs().sum() > 0
    # off the mask (observations, padding rows) nothing
    assert not data.batch["advantages"][data.batch["response_mask"] == 0].any()


def test_advantages_reach_rm_scores_exactly():
    tok, _, loop, tree, policy, outs = grow()
    want = [list(o.extra_fields[bv.ADVANTAGES_FIELD]) for o in outs]
    cfg = trainer_config()
    worker = bv.BranchingAgentLoopWorker.__new__(bv.BranchingAgentLoopWorker)
    worker.rollout_config = cfg.actor_rollout_ref.rollout
    worker.tokenizer, worker.processor = tok, None
    worker.reward_loop_worker_handles, worker.distillation_enabled = None, False
    worker.mm_processor_kwargs = {}
    padded = asyncio.run(worker._agent_loop_postprocess(outs, validate=False, raw_prompt=[]))
    data = worker._postprocess([padded])
    for i, values in enumerate(want):
        got = data.batch["rm_scores"][i]
        torch.testing.assert_close(
            got[: len(values)], torch.tensor(values, dtype=torch.float32), rtol=0, atol=0
        )
        assert not got[len(values) :].any()


def test_kl_in_reward_is_refused():
    fn = get_adv_estimator_fn(bv.ESTIMATOR_NAME)
    with pytest.raises(TrainingConfigError, match="use_kl_in_reward"):
        fn(torch.zeros(1, 3), torch.ones(1, 3), config=AlgoConfig(use_kl_in_reward=True))


def test_too_few_rows_and_bad_options_are_typed_errors():
    tok = tiny_tokenizer()
    with pytest.raises(TrainingConfigError, match="rollout.n"):
        loop = make_loop(FakeServerManager(tok), tok, trainer_config(n=2))
        asyncio.run(loop.run({}, **ROW, branchgym_rows=2))
    cfg = trainer_config()
    with pytest.raises(TrainingConfigError, match="tail"):  # hydra would wrap it: direct
        bv.BranchingAgentLoop(
            trainer_config=DictConfigWrap(config=cfg),
            server_manager=FakeServerManager(tok),
            tokenizer=tok,
            processor=None,
            dataset_cls=None,
            data_config=DictConfigWrap(cfg.data),
            tail="sideways",
        )
    with pytest.raises(TrainingConfigError, match="response_length"):
        loop = make_loop(FakeServerManager(tok), tok, trainer_config(response_length=8))
        asyncio.run(loop.run({}, **ROW))


def test_first_copies_takes_one_row_per_prompt():
    base = DataProto.from_dict(
        non_tensors={"uid": np.array(["a", "b"], dtype=object), "index": np.array([0, 1])}
    )
    rep = base.repeat(repeat_times=3, interleave=True)
    firsts = bv.first_copies(rep, 3)
    assert list(firsts.non_tensor_batch["uid"]) == ["a", "b"]
    assert list(firsts.non_tensor_batch["branchgym_rows"]) == [3, 3]
    with pytest.raises(TrainingConfigError, match="interleaved"):
        bv.first_copies(base.repeat(repeat_times=3, interleave=False), 3)


def test_v1_trainer_stores_each_path_as_a_row_with_its_advantages(monkeypatch):
    """verl's default (v1) worker: each output of the loop is a row; rm_scores = advantages."""
    from verl.trainer.ppo.v1 import agent_loop_tq
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    tok, _, loop, tree, policy, outs = grow()

    class Store:  # verl's TransferQueue client, in memory
        def __init__(self):
            self.puts = []

        async def async_kv_batch_put(self, keys, fields, tags, partition_id):
            self.puts.append((keys, fields, tags, partition_id))

    store = Store()
    monkeypatch.setattr(agent_loop_tq, "tq", store)
    cls = agent_loop_tq.AgentLoopWorkerTQ.__ray_actor_class__  # the class under @ray.remote
    worker = cls.__new__(cls)
    worker.tokenizer, worker.processor = tok, None
    worker.reward_loop_worker_handles, worker.distillation_enabled = None, False
    worker.mm_processor_kwargs = {}
    want = [np.asarray(o.extra_fields[bv.ADVANTAGES_FIELD]) for o in outs]
    masks = [np.asarray(o.response_mask) for o in outs]
    returns = [o.extra_fields["branchgym_return"] for o in outs]
    asyncio.run(
        worker._agent_loop_postprocess(
            outs, False, uid="p0", session_id=0, global_steps=1, raw_prompt=[], **ROW["extra_info"]
        )
    )
    ((keys, fields, _, partition),) = store.puts
    assert keys == [f"p0_0_{i}" for i in range(N)] and partition == "train"
    for i in range(N):
        np.testing.assert_array_equal(fields["rm_scores"][i].numpy(), want[i].astype(np.float32))
        np.testing.assert_array_equal(fields["response_mask"][i].numpy(), masks[i])
    # each path keeps its own return (verl copies the last output's reward to the others)
    assert [o.extra_fields["branchgym_return"] for o in outs] == returns

    # the v1 trainer's advantage step on those rows, through verl's registry
    td = fields.select("response_mask", "rm_scores")
    data = DataProto(batch=td.to_padded_tensor())
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data.non_tensor_batch["uid"] = np.array(["p0"] * N, dtype=object)
    before = data.batch["rm_scores"].clone()
    data = compute_advantage_for_multi_trajectories(
        data, batch_keys=keys, adv_estimator=bv.ESTIMATOR_NAME, config=AlgoConfig()
    )
    torch.testing.assert_close(data.batch["advantages"], before, rtol=0, atol=0)


def test_verl_loads_branchgym_as_a_plugin_in_a_fresh_process():
    """``import verl`` alone (what every Ray worker does) registers both (verl.plugins)."""
    import subprocess
    import sys

    code = (
        "import verl\n"
        "from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY as est\n"
        "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as loops\n"
        f"print({bv.ESTIMATOR_NAME!r} in est, {bv.AGENT_NAME!r} in loops)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert proc.stdout.split()[-2:] == ["True", "True"], proc.stdout + proc.stderr[-2000:]


def test_the_docs_gpu_config_is_a_valid_verl_config():
    """docs/integrations.md's two YAML files: verl's schema takes every key they set."""
    import os
    import pathlib

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    root = pathlib.Path(__file__).resolve().parents[3]
    blocks = re.findall(r"```yaml\n(.*?)```", (root / "docs/integrations.md").read_text(), re.S)
    loops, trainer = (OmegaConf.create(b) for b in blocks[:2])
    with initialize_config_dir(
        os.path.join(os.path.dirname(verl.__file__), "trainer/config"), version_base=None
    ):
        base = compose("ppo_trainer")
    OmegaConf.set_struct(base, True)  # an unknown key raises
    ours = {k: v for k, v in OmegaConf.to_container(trainer).items() if k != "defaults"}
    cfg = OmegaConf.merge(base, ours)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert rollout.calculate_log_probs and rollout.agent.default_agent_loop == bv.AGENT_NAME
    assert omega_conf_to_dataclass(cfg.algorithm).adv_estimator == bv.ESTIMATOR_NAME
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).loss_agg_mode == "token-mean"
    # the agent-loop file builds the registered loop with its options
    (entry,) = OmegaConf.to_container(loops)
    assert entry["name"] == bv.AGENT_NAME
    options = {k: v for k, v in entry.items() if k not in ("name", "_target_")}
    tok = tiny_tokenizer()
    loop = make_loop(FakeServerManager(tok), tok, **options)
    assert type(loop).__module__ + "." + type(loop).__qualname__ == entry["_target_"]
    assert loop.paths_per_tree == 7 and loop.env_id == "branchgym/WebShop-v0"
