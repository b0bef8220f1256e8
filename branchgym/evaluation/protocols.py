"""Pinned evaluation protocols: which tasks, on which data, with which cap and prompt.

A :class:`Protocol` names an env configuration and how to list its tasks. Resolved
against the env (:meth:`Protocol.resolve`), it becomes a :class:`PinnedProtocol`: the task
ids with their reset options, a digest of the data they come from, the step cap and the
prompt format, all hashed into :attr:`PinnedProtocol.hash`. Two runs are comparable when
their hashes are equal; a run on a subset of the tasks, another cap or other data (a
``data_dir``) gets another hash and says so (:attr:`PinnedProtocol.deviations`).

The shipped protocols (:data:`PROTOCOLS`):

* ``webshop-test``: WebShop's 500 ``test`` goals (upstream's split of the seed-233
  shuffled goal list), upstream's 15-step cap; average score x100 and success rate. On
  the generated 1,000-product catalog unless ``data_dir`` points at the real data;
* ``webshop-small``: the first 200 of those goals with a 6-step cap (search, a product,
  up to three options, Buy Now): the protocol of the reference results, where a 135M model
  is trained and scored on a CPU (docs/results.md, Reference results);
* ``alfworld-thor-seen`` / ``alfworld-thor-unseen``: ALFWorld's seen (140 games) and
  unseen (134) sets on the AI2-THOR floor plans the engine ships, 50 steps; success rate
  overall and per task type;
* ``swebench-realistic``: the 20 shipped realistic SWE-bench tasks; resolved / total
  with the harness's report fields;
* ``texttree-ci``: 64 seeds of the CI maze (TextTreeMDP depth 3), for tests and quick
  checks (its values are exact, :mod:`branchgym.envs.toy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from branchgym.digest import stable_hash
from branchgym.error import OptionError

__all__ = [
    "PROTOCOLS",
    "PinnedProtocol",
    "Protocol",
    "Task",
    "get_protocol",
    "prompt_format",
]


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of a protocol: its id, the reset seed and the reset options that pick it."""

    id: str
    seed: int
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


def prompt_format(env_id: str) -> dict[str, str]:
    """The prompt builder a protocol's text agents use, and a digest of what it says."""
    from branchgym.agents.policies.prompts import prompt_for

    builder = prompt_for(env_id)
    text = {"system": builder.system_prompt(), "examples": builder.examples()}
    return {"builder": type(builder).__name__, "digest": stable_hash(text, size=8)}


@dataclasses.dataclass(frozen=True)
class PinnedProtocol:
    """A protocol resolved against its data: everything that decides comparability.

    Attributes:
        name: The protocol's name.
        version: Its version (bumped whenever the task list, cap or scoring changes).
        env_id: The env.
        env_kwargs: Its keyword arguments (``data_dir`` included when given).
        tasks: The tasks, in order.
        max_steps: Step cap per episode.
        data_digest: Digest of the data the tasks come from.
        prompt: :func:`prompt_format` of the env.
        metric: ``success`` or ``score`` (WebShop: reward x100 and success).
        category_key: The info key whose value groups tasks in the per-category table.
        deviations: How this run differs from the shipped protocol (empty: it does not).
    """

    name: str
    version: int
    env_id: str
    env_kwargs: dict[str, Any]
    tasks: tuple[Task, ...]
    max_steps: int
    data_digest: str
    prompt: dict[str, str]
    metric: str
    category_key: str | None
    deviations: tuple[str, ...] = ()

    @property
    def hash(self) -> str:
        """16 hex digits of task ids, data digest, step cap and prompt format."""
        return stable_hash(
            {
                "name": self.name,
                "version": self.version,
                "env_id": self.env_id,
                "tasks": [(t.id, t.seed, t.options) for t in self.tasks],
                "max_steps": self.max_steps,
                "data": self.data_digest,
                "prompt": self.prompt,
                "metric": self.metric,
            },
            size=8,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description (task ids only; their options follow from the name)."""
        return {
            "name": self.name,
            "version": self.version,
            "hash": self.hash,
            "env_id": self.env_id,
            "env_kwargs": self.env_kwargs,
            "tasks": len(self.tasks),
            "task_ids": [t.id for t in self.tasks],
            "task_specs": [[t.id, t.seed, t.options] for t in self.tasks],
            "max_steps": self.max_steps,
            "data_digest": self.data_digest,
            "prompt": self.prompt,
            "metric": self.metric,
            "category_key": self.category_key,
            "deviations": list(self.deviations),
        }


@dataclasses.dataclass(frozen=True)
class Protocol:
    """A named, versioned way to evaluate an agent on one env.

    Attributes:
        name: ``webshop-test``, ...
        version: Bumped whenever what it measures changes.
        env_id: The registered env.
        env_kwargs: Keyword arguments of ``gym.make`` (``data_dir`` may be added).
        max_steps: Step cap per episode (upstream's).
        metric: ``success`` or ``score``.
        category_key: Info key of the per-category table (``task_type``), or None.
        list_tasks: ``env -> [Task]`` (the env made with ``env_kwargs``).
        data_digest: ``env -> str``.
        description: One line for ``--help`` and reports.
        published: Published figures for context (text, with their source papers).
    """

    name: str
    version: int
    env_id: str
    env_kwargs: dict[str, Any]
    max_steps: int
    metric: str
    category_key: str | None
    list_tasks: Callable[[Any], list[Task]]
    data_digest: Callable[[Any], str]
    description: str
    published: str = ""

    def resolve(
        self,
        *,
        data_dir: str | None = None,
        tasks: int | Sequence[str] | None = None,
        max_steps: int | None = None,
        env_kwargs: dict[str, Any] | None = None,
    ) -> PinnedProtocol:
        """Make the env, list the tasks and digest the data.

        Args:
            data_dir: Real data instead of the shipped data (another digest).
            tasks: The first N tasks, or these task ids (a subset: a deviation).
            max_steps: Another step cap (a deviation).
            env_kwargs: More keyword arguments of the env (a deviation when they differ
                from the protocol's).
        """
        import gymnasium as gym

        import branchgym  # noqa: F401 - registers the envs

        kwargs = dict(self.env_kwargs)
        deviations: list[str] = []
        if env_kwargs:
            changed = {k: v for k, v in env_kwargs.items() if kwargs.get(k) != v}
            if changed:
                deviations.append(f"env kwargs {changed}")
            kwargs.update(env_kwargs)
        if data_dir is not None:
            kwargs["data_dir"] = str(data_dir)
            deviations.append(f"data_dir {data_dir}")
        env = gym.make(self.env_id, **kwargs)
        try:
            listed = self.list_tasks(env)
            digest = self.data_digest(env)
        finally:
            env.close()
        if tasks is not None:
            if isinstance(tasks, int):
                if tasks < 1:
                    raise OptionError(f"--tasks must be at least 1; got {tasks}")
                chosen = listed[:tasks]
            else:
                by_id = {t.id: t for t in listed}
                missing = [t for t in tasks if t not in by_id]
                if missing:
                    raise OptionError(
                        f"protocol {self.name} has no task {missing[0]!r}; its tasks are "
                        f"{listed[0].id} ... {listed[-1].id} ({len(listed)} in all)"
                    )
                chosen = [by_id[t] for t in tasks]
            if len(chosen) < len(listed):
                deviations.append(f"{len(chosen)} of {len(listed)} tasks")
            listed = chosen
        cap = self.max_steps
        if max_steps is not None and max_steps != self.max_steps:
            if max_steps < 1:
                raise OptionError(f"--max-steps must be at least 1; got {max_steps}")
            deviations.append(f"step cap {max_steps} instead of {self.max_steps}")
            cap = max_steps
        return PinnedProtocol(
            name=self.name,
            version=self.version,
            env_id=self.env_id,
            env_kwargs=kwargs,
            tasks=tuple(listed),
            max_steps=cap,
            data_digest=digest,
            prompt=prompt_format(self.env_id),
            metric=self.metric,
            category_key=self.category_key,
            deviations=tuple(deviations),
        )


# ---------------------------------------------------------------- the shipped protocols
def _webshop_tasks(env: Any) -> list[Task]:
    goals = env.unwrapped.catalog.split_range("test")
    return [Task(f"test-{i}", 0, {"goal_index": i, "split": "test"}) for i in range(len(goals))]


def _webshop_small_tasks(env: Any) -> list[Task]:
    return _webshop_tasks(env)[:SMALL_GOALS]


def _webshop_digest(env: Any) -> str:
    catalog = env.unwrapped.catalog
    return stable_hash({"catalog": catalog.fingerprint, "test": list(catalog.split_range("test"))})


def _alfworld_tasks(env: Any) -> list[Task]:
    return [Task(p.name, 0, {"problem": p.name}) for p in env.unwrapped.problems]


def _alfworld_digest(env: Any) -> str:
    return stable_hash(
        [(p.name, p.task_type, p.pddl_problem, p.grammar) for p in env.unwrapped.problems]
    )


def _swebench_tasks(env: Any) -> list[Task]:
    return [Task(t.instance_id, 0, {"instance_id": t.instance_id}) for t in env.unwrapped.tasks]


def _swebench_digest(env: Any) -> str:
    return stable_hash(
        [
            (t.instance_id, t.base_commit, t.test_patch, t.fail_to_pass, t.pass_to_pass)
            for t in env.unwrapped.tasks
        ]
    )


def _texttree_tasks(env: Any) -> list[Task]:
    return [Task(f"seed-{s}", s) for s in range(64)]


def _texttree_digest(env: Any) -> str:
    return stable_hash({"maze": env.unwrapped.snapshot_identity()})


def _webshop_protocol(
    name: str,
    max_steps: int,
    list_tasks: Callable[[Any], list[Task]],
    description: str,
    *,
    published: str,
    version: int = 1,
) -> Protocol:
    """A protocol on WebShop's ``test`` goals: average score x100 and success."""
    return Protocol(
        name=name,
        version=version,
        env_id="branchgym/WebShop-v0",
        env_kwargs={"split": "test", "max_steps": max_steps},
        max_steps=max_steps,
        metric="score",
        category_key=None,
        list_tasks=list_tasks,
        data_digest=_webshop_digest,
        description=description,
        published=published,
    )


#: Test goals of ``webshop-small``: the first 200 of the 500 (issue-sized for CPU evals).
SMALL_GOALS = 200

#: name -> protocol.
PROTOCOLS: dict[str, Protocol] = {
    "webshop-test": _webshop_protocol(
        "webshop-test",
        15,
        _webshop_tasks,
        "WebShop's 500 test goals, 15 steps: score x100 and success rate",
        published=(
            "WebShop paper (Yao et al. 2022), test set: IL 59.9 score / 29.1 % success, "
            "IL+RL 62.4 / 28.7 %, human experts 82.1 / 59.6 %; ReAct (Yao et al. 2023, "
            "PaLM-540B prompting) 66.6 / 40.0 %"
        ),
    ),
    "webshop-small": _webshop_protocol(
        "webshop-small",
        6,
        _webshop_small_tasks,
        "the first 200 WebShop test goals, 6 steps: the reference-results protocol "
        "(docs/results.md), sized for a 135M model on a CPU",
        published="none: a small-model protocol of this project (docs/results.md)",
    ),
    **{
        f"alfworld-thor-{split}": Protocol(
            name=f"alfworld-thor-{split}",
            version=1,
            env_id="branchgym/ALFWorld-v0",
            env_kwargs={"problems": f"thor_{split}"},
            max_steps=50,
            metric="success",
            category_key="task_type",
            list_tasks=_alfworld_tasks,
            data_digest=_alfworld_digest,
            description=f"ALFWorld's {games} {split} games on AI2-THOR floor plans, 50 steps: "
            "success",
            published=(
                "ReAct (Yao et al. 2023, PaLM-540B prompting) 71 % on the 134 unseen games, "
                "against 37 % for ALFWorld's BUTLER agent in the same table"
            ),
        )
        for split, games in (("seen", 140), ("unseen", 134))
    },
    "swebench-realistic": Protocol(
        name="swebench-realistic",
        version=1,
        env_id="branchgym/SWEBench-v0",
        env_kwargs={"tasks": "realistic"},
        max_steps=50,
        metric="success",
        category_key=None,
        list_tasks=_swebench_tasks,
        data_digest=_swebench_digest,
        description="the 20 shipped realistic SWE-bench tasks, 50 commands: resolved / total",
        published=(
            "not comparable: published SWE-bench figures are on upstream's 2,294 (or "
            "Verified's 500) instances of 12 large repositories"
        ),
    ),
    "texttree-ci": Protocol(
        name="texttree-ci",
        version=1,
        env_id="branchgym/TextTreeMDP-v0",
        env_kwargs={"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2},
        max_steps=10,
        metric="success",
        category_key=None,
        list_tasks=_texttree_tasks,
        data_digest=_texttree_digest,
        description="64 seeds of the CI maze (TextTreeMDP depth 3), 10 steps: success",
    ),
}


def get_protocol(name: str) -> Protocol:
    """The protocol called ``name``, or an error listing the shipped ones."""
    try:
        return PROTOCOLS[name]
    except KeyError:
        import difflib

        near = difflib.get_close_matches(name, PROTOCOLS, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise OptionError(
            f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}.{hint}"
        ) from None
