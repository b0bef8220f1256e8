"""Agent specs: what ``branchgym eval --agent SPEC`` can score, each resolved to an agent.

=====================================  ================================================
spec                                   agent
=====================================  ================================================
``random``                             uniform over the env's admissible actions
                                       (:class:`~branchgym.agents.policies.policy.TextPolicy`)
``expert``                             the env's scripted expert or planner
                                       (:mod:`branchgym.agents.policies.experts`)
``gold``                               SWE-bench: each task's gold patch, graded as a
                                       prediction (the grader's ceiling)
``module.path:attr``                   a policy object, a class or factory that makes one,
                                       or a function ``f(context) -> action``
``tiny``, ``smollm2``, a folder        a Hugging Face model folder, a Hub id in the local
                                       cache, or a ``branchgym train`` run or checkpoint
                                       (its latest checkpoint), generated through
                                       :class:`~branchgym.agents.engines.hf.HFEngine`'s
                                       batched decoding (temperature 1: the policy as
                                       trained), or as the scoring policy (the softmax
                                       over the admissible actions) where the run
                                       trained one or ``--policy scoring`` asks
``http://host:port/v1``                an OpenAI-compatible chat endpoint (``--model``,
                                       ``--api-key-env``, sampling options):
                                       :class:`~branchgym.evaluation.endpoint.EndpointPolicy`
=====================================  ================================================

A resolved :class:`Agent` is either a *policy* (the policy protocol: contexts in, actions
out; episodes advance in lockstep batches through the engine and the envs through an
executor) or an *env agent* (``expert``: it reads the live env, so each episode runs
in-process beside its env). :attr:`Agent.config` is what a resumed run must match.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.digest import stable_hash
from branchgym.error import CheckpointError, OptionError
from branchgym.rollout.policy import ActionSample, ActRequest, Policy

__all__ = [
    "DTYPES",
    "Agent",
    "FunctionPolicy",
    "POLICY_CHOICES",
    "agent_kind",
    "gold_agent",
    "make_agent",
    "predictions_agent",
]

#: ``--dtype`` of model agents: the weights' type while they act. ``bfloat16`` is a
#: deviation from the policy as trained in float32 (its log-probs differ in the third
#: digit) that acts about 1.7x faster on CPUs with AVX512-BF16; it is in the agent's
#: configuration, so runs in the two types are never resumed into each other.
DTYPES = ("float32", "bfloat16")

#: ``--policy`` of model agents: ``generate`` (free generation, parsed), ``scoring`` (the
#: softmax over the admissible actions' log-probs), ``auto`` (what the train run used).
POLICY_CHOICES = ("auto", "generate", "scoring")

_MODULE_ATTR = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclasses.dataclass
class Agent:
    """A resolved agent.

    Attributes:
        spec: The spec it came from.
        kind: ``random``, ``expert``, ``callable``, ``model`` or ``endpoint``.
        policy: The policy (None for an env agent).
        expert: ``(env, rng) -> act(observation, info)`` for an env agent, else None.
        config: Everything that decides its behaviour (a resumed run must match it).
        predictions: SWE-bench predictions, ``{instance_id: model_patch}`` (kind
            ``predictions``), else None.
    """

    spec: str
    kind: str
    policy: Policy | None
    expert: Any
    config: dict[str, Any]
    predictions: dict[str, str] | None = None

    @property
    def config_hash(self) -> str:
        """16 hex digits of :attr:`config`."""
        return stable_hash(self.config, size=8)


class FunctionPolicy:
    """A plain function ``f(context) -> action`` as a policy (one action per sample)."""

    def __init__(self, fn: Any) -> None:
        """Wrap ``fn``."""
        self.fn = fn

    def act(self, requests: list[ActRequest], rng: np.random.Generator) -> list[list[Any]]:
        """Call the function once per requested sample."""
        out = []
        for req in requests:
            samples = []
            for _ in range(req.n):
                action = self.fn(req.context)
                samples.append(
                    ActionSample(
                        action=action,
                        text=str(action),
                        token_ids=np.zeros(0, np.int64),
                        logprobs=np.zeros(0, np.float32),
                        entropies=np.zeros(0, np.float32),
                    )
                )
            out.append(samples)
        return out


def agent_kind(spec: str) -> str:
    """Which kind of agent ``spec`` names (without loading it)."""
    if spec in ("random", "expert", "gold"):
        return spec
    if spec.startswith(("http://", "https://")):
        return "endpoint"
    if spec in ("tiny", "smollm2") or spec.startswith("hf:"):
        return "model"
    path = Path(os.path.expanduser(spec))
    if path.exists():
        return "model"
    if _MODULE_ATTR.match(spec):
        return "callable"
    if re.match(r"^[\w.-]+/[\w.-]+(@[\w.-]+)?$", spec):
        return "model"  # a Hub id, read from the local cache
    raise OptionError(
        f"unknown agent {spec!r}: use random, expert, module.path:attr, a model folder or "
        "branchgym train run (or tiny, smollm2, a Hub id in the local cache), or an "
        "endpoint URL such as http://127.0.0.1:8000/v1 with --model"
    )


def _latest_checkpoint(folder: Path) -> Path:
    """A model folder: ``folder`` itself, or the latest ``checkpoint-*`` of a run folder."""
    from branchgym.agents.training.checkpoints import latest_checkpoint

    if (folder / "config.json").exists() or (folder / "adapter_config.json").exists():
        return folder
    ckpt = latest_checkpoint(folder)
    if ckpt is None:
        raise OptionError(
            f"{folder} is neither a model folder (config.json) nor a branchgym train run "
            "with a checkpoint-NNNNNN folder; pass the model folder or the run's --out"
        )
    return ckpt


def model_digest(path: str | Path) -> str:
    """The digest eval records for a model folder or train run (the model is not loaded)."""
    return _folder_digest(_latest_checkpoint(Path(os.path.expanduser(str(path))).resolve()))


def _folder_digest(folder: Path) -> str:
    """A digest of a model folder's contents: two folders with other weights differ.

    A ``branchgym train`` checkpoint records a SHA-256 per file in its
    ``trainer_state.json``: those are used as they are (free). Another folder's weight
    files are read and hashed (about a second per GB). Names and sizes alone would not do:
    a model retrained to the same path has the same sizes, and ``--resume`` would then mix
    two models' episodes in one run.
    """
    from branchgym.agents.training.checkpoints import load_checkpoint_state, sha256_file

    recorded: dict[str, str] = {}
    if (folder / "trainer_state.json").is_file():
        with contextlib.suppress(CheckpointError):
            recorded = load_checkpoint_state(folder, verify=False).get("files") or {}
    parts: list[Any] = []
    for p in sorted(folder.iterdir()):
        if not p.is_file():
            continue
        if p.name in recorded:
            parts.append((p.name, recorded[p.name]))
        elif p.suffix in (".safetensors", ".bin", ".pt", ".gguf") or p.name == "config.json":
            parts.append((p.name, sha256_file(p)))
        else:
            parts.append((p.name, p.stat().st_size))
    return stable_hash(parts, size=8)


def _trained_as(folder: Path) -> dict[str, Any]:
    """How the ``branchgym train`` checkpoint ``folder`` acted.

    Its ``trainer_state.json``'s policy kind and scoring template; ``{}`` for a model
    folder no run wrote.
    """
    from branchgym.agents.training.checkpoints import load_checkpoint_state

    if not (folder / "trainer_state.json").is_file():
        return {}
    state = load_checkpoint_state(folder, verify=False)  # the weights load next anyway
    args = state.get("args") or {}
    return {"policy": state.get("policy"), "scoring_template": args.get("scoring_template")}


def _model_agent(
    spec: str, *, max_new_tokens: int, threads: int | None, policy: str, dtype: str
) -> Agent:
    from branchgym.agents.engines.hf import HFEngine
    from branchgym.agents.policies.models import load_model
    from branchgym.agents.policies.policy import LLMPolicy
    from branchgym.agents.policies.scoring import DEFAULT_TEMPLATE, ScoringPolicy
    from branchgym.agents.training.policy_kinds import resolve_policy

    if policy not in POLICY_CHOICES:
        raise OptionError(f"--policy {policy!r}: use one of {', '.join(POLICY_CHOICES)}")
    if dtype not in DTYPES:
        raise OptionError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    name = spec[3:] if spec.startswith("hf:") else spec
    config: dict[str, Any] = {"kind": "model", "max_new_tokens": max_new_tokens}
    trained: dict[str, Any] = {}
    if name in ("tiny", "smollm2"):
        config["model"] = name
        source: Any = name
    elif Path(os.path.expanduser(name)).exists():
        folder = _latest_checkpoint(Path(os.path.expanduser(name)).resolve())
        config.update(model=str(folder), digest=_folder_digest(folder))
        source = folder
        trained = _trained_as(folder)
    else:
        config["model"] = name  # a Hub id from the local cache
        source = name
    if policy == "auto":  # the policy the run trained, else what train's auto would use
        policy = trained.get("policy") or resolve_policy("auto", name)
    template = str(trained.get("scoring_template") or DEFAULT_TEMPLATE)
    config["policy"] = policy
    if policy == "scoring":
        config["scoring_template"] = template
    if dtype != "float32":  # float32 runs keep the config (and hash) they always had
        config["dtype"] = dtype
    import torch

    model, tok = load_model(source, dtype=getattr(torch, dtype))
    # the engine's own default (float32 on a CPU) would cast a bfloat16 model back
    engine = HFEngine(
        model, tok, max_new_tokens=max_new_tokens, threads=threads, dtype=getattr(torch, dtype)
    )
    if policy == "scoring":
        acting: Any = ScoringPolicy(engine, template=template)
    else:
        acting = LLMPolicy(engine, max_new_tokens=max_new_tokens)
    return Agent(spec, "model", acting, None, config)


def _callable_agent(spec: str) -> Agent:
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise OptionError(
            f"agent {spec!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise OptionError(f"agent {spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        obj = obj()
        if not hasattr(obj, "act"):
            raise OptionError(
                f"agent {spec!r}: {attr}() made a {type(obj).__name__} without act(); a "
                "class must make a policy (act(requests, rng) -> samples)"
            )
    policy = obj if hasattr(obj, "act") else None
    if policy is None:
        if not callable(obj):
            raise OptionError(
                f"agent {spec!r} is a {type(obj).__name__}: give a policy, a class or "
                "factory making one, or a function f(context) -> action"
            )
        policy = FunctionPolicy(obj)
    return Agent(spec, "callable", policy, None, {"kind": "callable", "spec": spec})


def make_agent(
    spec: str,
    env_id: str,
    *,
    model: str | None = None,
    api_key_env: str | None = None,
    sampling: dict[str, Any] | None = None,
    max_new_tokens: int = 48,
    max_concurrent_requests: int = 8,
    threads: int | None = None,
    policy: str = "auto",
    dtype: str = "float32",
) -> Agent:
    """Resolve ``spec`` for ``env_id`` (see the module's table).

    Args:
        spec: The agent spec.
        env_id: The env it plays (``expert`` picks by it).
        model: The endpoint's model name (endpoints only).
        api_key_env: The environment variable holding the endpoint's key.
        sampling: Endpoint sampling options (``temperature``, ``top_p``, ``max_tokens``,
            ``seed``).
        max_new_tokens: Tokens per action of a model agent.
        max_concurrent_requests: Concurrent requests to an endpoint.
        threads: torch threads of a model agent.
        policy: How a model agent acts (:data:`POLICY_CHOICES`): ``auto`` plays a train
            run's checkpoint with the policy it trained (``scoring`` or ``generate``),
            ``tiny`` with ``scoring`` and any other model with ``generate``.
        dtype: A model agent's weight type (:data:`DTYPES`).
    """
    kind = agent_kind(spec)
    sampling = dict(sampling or {})
    if (policy != "auto" or dtype != "float32") and kind != "model":
        raise OptionError(
            f"--policy and --dtype are for model agents (a model folder, train run, tiny or "
            f"smollm2); {spec!r} is a {kind} agent"
        )
    if kind != "endpoint" and (model is not None or api_key_env is not None or sampling):
        raise OptionError(
            f"--model, --api-key-env and sampling options are for endpoint agents; "
            f"{spec!r} is a {kind} agent"
        )
    if kind == "gold":
        raise OptionError("gold is SWE-bench's reference agent: resolve it with gold_agent()")
    if kind == "random":
        from branchgym.agents.policies.policy import TextPolicy

        if env_id == "branchgym/SWEBench-v0":
            raise OptionError(
                "random picks among the env's admissible actions, and SWE-bench lists none "
                "(any shell command is an action); score gold, a model or predictions instead"
            )
        return Agent(spec, kind, TextPolicy(), None, {"kind": kind})
    if kind == "expert":
        from branchgym.agents.policies.experts import AUTO_EXPERTS, EXPERTS

        name = AUTO_EXPERTS.get(env_id)
        if name is None:
            raise OptionError(
                f"no scripted expert for {env_id}; experts exist for "
                f"{', '.join(AUTO_EXPERTS)}"
            )
        return Agent(spec, kind, None, EXPERTS[name], {"kind": kind, "expert": name})
    if kind == "callable":
        return _callable_agent(spec)
    if kind == "model":
        return _model_agent(
            spec, max_new_tokens=max_new_tokens, threads=threads, policy=policy, dtype=dtype
        )
    if model is None:
        raise OptionError(
            f"an endpoint agent needs --model (the name the server at {spec} serves)"
        )
    from branchgym.evaluation.endpoint import EndpointPolicy

    policy = EndpointPolicy(
        base_url=spec,
        model=model,
        api_key_env=api_key_env,
        max_concurrent=max_concurrent_requests,
        **sampling,
    )
    config = {"kind": kind, "base_url": spec, "model": model, "sampling": sampling}
    return Agent(spec, kind, policy, None, config)


def _read_predictions(path: Path) -> list[tuple[int, Any]]:
    """``(line, record)`` from a ``.jsonl`` file or a ``.json`` list (the harness takes both)."""
    from branchgym.error import DataError

    text = path.read_text()
    if path.suffix == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} is not valid JSON ({exc}); give a list") from exc
        if isinstance(doc, dict):  # {instance_id: prediction}, as upstream also accepts
            doc = list(doc.values())
        if not isinstance(doc, list):
            raise DataError(f"{path} holds a {type(doc).__name__}; give a list of predictions")
        return list(enumerate(doc, 1))
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}:{n} is not a JSON object ({exc.msg}); one prediction per line"
            ) from exc
    return rows


def predictions_agent(path: str | os.PathLike[str], task_ids: list[str]) -> Agent:
    """SWE-bench predictions in the harness's format, checked against the protocol's tasks.

    Each prediction has ``instance_id``, ``model_name_or_path`` and ``model_patch`` (a
    unified diff; empty or null: an empty patch). A malformed line, a missing field, a
    duplicate instance or an instance the protocol does not have is a
    :class:`~branchgym.error.DataError` naming the line and the fix.
    """
    from branchgym.error import DataError

    file = Path(path)
    if not file.is_file():
        raise DataError(f"no predictions file {file}; give the harness's predictions .jsonl")
    preds: dict[str, str] = {}
    models: set[str] = set()
    known = set(task_ids)
    for n, rec in _read_predictions(file):
        where = f"{file}:{n}"
        if not isinstance(rec, dict):
            raise DataError(f"{where}: a prediction is an object, got {type(rec).__name__}")
        missing = [k for k in ("instance_id", "model_name_or_path", "model_patch") if k not in rec]
        if missing:
            raise DataError(
                f"{where}: missing {', '.join(missing)} (each prediction needs instance_id, "
                "model_name_or_path and model_patch)"
            )
        iid, patch = rec["instance_id"], rec["model_patch"]
        if not isinstance(iid, str) or not (patch is None or isinstance(patch, str)):
            raise DataError(f"{where}: instance_id must be a string and model_patch a string")
        if iid in preds:
            raise DataError(f"{where}: a second prediction for {iid}; keep one per instance")
        if iid not in known:
            raise DataError(
                f"{where}: {iid} is not a task of this protocol ({len(known)} tasks, e.g. "
                f"{sorted(known)[0]}); evaluate it with the protocol that has it"
            )
        preds[iid] = patch or ""
        models.add(str(rec["model_name_or_path"]))
    if not preds:
        raise DataError(f"{file} holds no prediction")
    digest = stable_hash(file.read_bytes(), size=8)
    config = {"kind": "predictions", "file": str(file.resolve()), "digest": digest,
              "models": sorted(models)}  # fmt: skip
    return Agent(f"predictions:{file.name}", "predictions", None, None, config, preds)


def gold_agent(env_kwargs: dict[str, Any], task_ids: list[str]) -> Agent:
    """SWE-bench's gold patches as predictions: what the grader gives a correct fix."""
    import gymnasium as gym

    import branchgym  # noqa: F401 - registers the envs

    env = gym.make("branchgym/SWEBench-v0", **env_kwargs)
    try:
        patches = {t.instance_id: t.patch for t in env.unwrapped.tasks}
    finally:
        env.close()
    preds = {t: patches[t] for t in task_ids}
    digest = stable_hash(preds, size=8)
    return Agent("gold", "predictions", None, None, {"kind": "gold", "digest": digest}, preds)
