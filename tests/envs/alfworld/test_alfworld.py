"""branchgym/ALFWorld-v0: the real engine, its problem sets, and both snapshot paths."""

import dataclasses
import gzip
import io
import json
import os
import pickle
import re

import gymnasium as gym
import numpy as np
import pytest

import branchgym
from branchgym.envs.alfworld import engine as engine_mod
from branchgym.envs.alfworld.problems import (
    export_tw_pddl,
    generate_problem,
    generate_split,
    load_problem_set,
    load_problems,
    save_problems,
)
from branchgym.envs.alfworld.tasks import (
    LAYOUTS,
    SPLIT_LAYOUTS,
    SPLIT_TASK_COUNTS,
    TASK_TYPES,
)
from branchgym.error import (
    DataError,
    DependencyMissingError,
    InvalidActionError,
    ResetNeededError,
    SnapshotCorruptError,
    SnapshotMismatchError,
)
from branchgym.fidelity.checks import check_env, run_actions

needs_engine = pytest.mark.skipif(
    not engine_mod.engine_available(), reason="ALFWorld engine not installed (make alfworld)"
)

ID = "branchgym/ALFWorld-v0"


def test_engine_is_installed_where_ci_runs():
    # make test installs the engine; a CI run must never skip the engine tests silently.
    if os.environ.get("CI"):
        assert engine_mod.engine_available()


# ------------------------------------------------------------------ shipped sets


@pytest.mark.parametrize("split", ["in_distribution", "out_of_distribution"])
def test_shipped_sets_mirror_alfworld_splits(split):
    problems = load_problem_set(split)
    assert len(problems) == {"in_distribution": 140, "out_of_distribution": 134}[split]
    counts = tuple(sum(p.task_type == t for p in problems) for t in TASK_TYPES)
    assert counts == SPLIT_TASK_COUNTS[split]
    assert len({p.name for p in problems}) == len(problems)
    assert {p.layout for p in problems} <= set(SPLIT_LAYOUTS[split])
    for p in problems:
        assert p.split == split and p.expert_plan and 0 < len(p.expert_plan) <= 30
        assert 4 <= p.num_receptacles <= 12
        assert "(:domain alfred)" in p.pddl_problem and p.goal


def test_splits_use_disjoint_rooms_covering_4_to_12_receptacles():
    seen = {p.layout for p in load_problem_set("in_distribution")}
    unseen = {p.layout for p in load_problem_set("out_of_distribution")}
    assert seen and unseen and not seen & unseen
    sizes = {
        p.num_receptacles
        for s in ("in_distribution", "out_of_distribution")
        for p in load_problem_set(s)
    }
    assert min(sizes) == 4 and max(sizes) == 12


def test_unknown_set_and_missing_path_say_what_exists(tmp_path):
    with pytest.raises(DataError, match="in_distribution"):
        load_problem_set("valid_seen")
    with pytest.raises(DataError, match="no such shipped set, file or folder"):
        load_problems(tmp_path / "nope")
    with pytest.raises(DataError, match="no solvable ALFWorld"):
        load_problems(tmp_path)


def test_malformed_problem_files_raise_data_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"name": "x"}\n')
    with pytest.raises(DataError, match="lacks"):
        load_problems(bad)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(b"{not json\n"))
    with pytest.raises(DataError, match="not JSON"):
        load_problems(broken)
    truncated = tmp_path / "t.jsonl.gz"
    truncated.write_bytes(gzip.compress(b'{"a": 1}\n' * 100)[:30])
    with pytest.raises(DataError):
        load_problems(truncated)
    game = tmp_path / "g" / "game.tw-pddl"
    game.parent.mkdir()
    game.write_text(json.dumps({"pddl_problem": "(define)"}))
    with pytest.raises(DataError, match="lacks"):
        load_problems(game)


def test_save_and_load_round_trip(tmp_path):
    problems = load_problem_set("out_of_distribution")[:5]
    path = save_problems(problems, tmp_path / "p.jsonl.gz")
    assert load_problems(path) == problems
    # Same problems, same bytes: the shipped files are reproducible artefacts.
    assert save_problems(problems, tmp_path / "q.jsonl.gz").read_bytes() == path.read_bytes()


# ------------------------------------------------------------------ generator


@needs_engine
def test_generator_rebuilds_shipped_problems_from_their_seed():
    for split, positions in (
        ("in_distribution", [0, 75]),
        ("out_of_distribution", [133]),
        ("thor_seen", [0, 139]),
        ("thor_unseen", [60]),
    ):
        rebuilt = generate_split(split, only=positions, progress=False)
        shipped = load_problem_set(split)
        assert [p.to_json() for p in rebuilt] == [shipped[i].to_json() for i in positions]


@needs_engine
def test_generator_is_seeded_and_follows_alfworld_conventions():
    a = generate_problem("kitchen_d", "pick_heat_then_place_in_recep", 7)
    b = generate_problem("kitchen_d", "pick_heat_then_place_in_recep", 7)
    c = generate_problem("kitchen_d", "pick_heat_then_place_in_recep", 8)
    assert a == b and a.pddl_problem != c.pddl_problem
    assert "_bar_SinkBasin - receptacle" in a.pddl_problem  # sinks as ALFWorld names them
    assert "(heatable " in a.pddl_problem and "(openable Fridge_bar_" in a.pddl_problem
    assert a.goal.startswith(("put a hot ", "heat some ")) and a.num_receptacles == 4
    assert a.expert_plan and any(s.startswith("heat ") for s in a.expert_plan)


@needs_engine
def test_generator_refuses_tasks_a_room_cannot_pose():
    with pytest.raises(ValueError, match="cannot be posed"):
        generate_problem("livingroom_a", "pick_cool_then_place_in_recep", 0)
    with pytest.raises(ValueError, match="unknown task type"):
        generate_problem("kitchen_a", "juggle", 0)
    assert set(LAYOUTS) >= set(SPLIT_LAYOUTS["in_distribution"])


@needs_engine
def test_unsolvable_goal_is_a_typed_load_error():
    p = next(
        q
        for q in load_problem_set("in_distribution")
        if q.task_type == "pick_and_place_simple" and "Knife_bar_" not in q.pddl_problem
    )
    # KnifeType is declared (the domain names it) but no knife exists: the goal is
    # unreachable, the translator simplifies it away and fails, as ALFWorld's loader does.
    head, goal = p.pddl_problem.split("(:goal", 1)
    goal = re.sub(r"\(objectType \?o \w+Type\)", "(objectType ?o KnifeType)", goal)
    assert "KnifeType" in goal
    broken = dataclasses.replace(p, name="broken", pddl_problem=head + "(:goal" + goal)
    engine = engine_mod.Engine()
    try:
        with pytest.raises(branchgym.error.GameLoadError):
            engine.load(broken)
            engine.reset()
    finally:
        engine.close()


# ------------------------------------------------------------------ the env


@pytest.fixture
def env():
    if not engine_mod.engine_available():
        pytest.skip("ALFWorld engine not installed")
    e = gym.make(ID)
    yield e
    e.close()


@needs_engine
def test_first_observation_has_the_task_and_admissible_actions(env):
    obs, info = env.reset(seed=3)
    assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-")
    assert f"Your task is to: {info['task']}." in obs
    assert "go to " in " ".join(info["admissible_actions"])
    assert info["admissible_actions"] == sorted(info["admissible_actions"])
    assert info["won"] is False and info["problem"] == env.unwrapped.problem.name


@needs_engine
def test_invalid_commands_are_answered_as_alfworld_does(env):
    _, info = env.reset(seed=1)
    facts = env.unwrapped.engine.current_facts().propositions()
    obs, reward, terminated, truncated, info2 = env.step("fly to the moon")
    assert obs == "Nothing happens." and reward == 0.0 and not (terminated or truncated)
    assert info2["invalid_action"] and info2["admissible_actions"] == info["admissible_actions"]
    assert env.unwrapped.engine.current_facts().propositions() == facts  # the world is as it was
    _, _, _, _, info3 = env.step(info["admissible_actions"][0])
    assert not info3["invalid_action"]
    with pytest.raises(InvalidActionError, match="admissible_actions"):
        env.step(3)
    fresh = gym.make(ID)
    with pytest.raises(ResetNeededError):
        fresh.unwrapped.step("look")
    fresh.close()


@needs_engine
def test_expert_wins_with_reward_one_and_episode_ends(env):
    from branchgym.envs.alfworld.expert import PlannerExpert

    env.reset(options={"problem": 5})
    expert = PlannerExpert(env)
    rewards = []
    for _ in range(30):
        obs, reward, terminated, truncated, info = env.step(expert())
        rewards.append(reward)
        if terminated:
            break
    assert info["won"] and rewards[-1] == 1.0 and sum(rewards) == 1.0
    with pytest.raises(ResetNeededError, match="over"):
        env.unwrapped.step("look")
    with pytest.raises(RuntimeError, match="no plan"):
        expert()


@needs_engine
@pytest.mark.parametrize("prefer_sas", [True, False])
def test_expert_replans_from_restored_states(prefer_sas):
    problem = load_problem_set("in_distribution")[30]
    env = gym.make(ID, problems=[problem], expert_plan_in_info=True, max_episode_steps=100)
    _, info = env.reset(options={"problem": 0})
    assert tuple(info["expert_plan"]) == problem.expert_plan
    env.step("look")
    env.step(problem.expert_plan[0])
    other = gym.make(ID, problems=[problem], max_episode_steps=100)
    other.unwrapped.engine.prefer_sas = prefer_sas
    with env.snapshot() as snap:
        other.restore(pickle.loads(pickle.dumps(snap)))
    assert other.unwrapped.restore_counts == {"portable": 1}
    plan = other.unwrapped.expert_plan()
    assert plan and len(plan) == len(problem.expert_plan) - 1
    results = run_actions(other, plan)
    assert results[-1][2] is True and results[-1][1] == 1.0
    env.close()
    other.close()


@needs_engine
def test_step_limit_is_alfworlds_50_by_default_and_configurable():
    e = gym.make(ID)
    e.reset(seed=0)
    cut = [e.step("look")[3] for _ in range(50)]
    assert cut == [False] * 49 + [True]
    e.close()
    short = gym.make(ID, max_episode_steps=3)
    short.reset(seed=0)
    assert [short.step("look")[3] for _ in range(3)] == [False, False, True]
    short.close()


@needs_engine
def test_reset_picks_problems_by_seed_or_by_option(env):
    a, _ = env.reset(seed=11)
    b, _ = env.reset(seed=11)
    assert a == b
    name = env.unwrapped.problems[7].name
    _, info = env.reset(options={"problem": name})
    assert info["problem"] == name
    with pytest.raises(ValueError, match="no problem named"):
        env.reset(options={"problem": "nope"})
    with pytest.raises(ValueError, match="out of range"):
        env.reset(options={"problem": 10_000})


@needs_engine
def test_out_of_distribution_and_user_games(tmp_path):
    ood = gym.make(ID, problems="out_of_distribution")
    _, info = ood.reset(seed=0)
    assert info["problem"] in {p.name for p in load_problem_set("out_of_distribution")}
    ood.close()
    # Real ALFWorld game files: export two problems as game.tw-pddl and load the folder.
    problems = load_problem_set("in_distribution")[:2]
    for p in problems:
        export_tw_pddl(p, tmp_path)
    unsolvable = tmp_path / "zz-unsolvable" / "game.tw-pddl"
    unsolvable.parent.mkdir()
    unsolvable.write_text(json.dumps({**problems[0].game(), "solvable": False}))
    games = load_problems(tmp_path)
    assert [g.name for g in games] == [p.name for p in problems]
    assert games[0].task_type == problems[0].task_type and games[0].goal == problems[0].goal
    a = gym.make(ID, problems=str(tmp_path))
    b = gym.make(ID, problems=list(problems))
    for e in (a, b):
        e.reset(options={"problem": 1})
    plan = list(problems[1].expert_plan)
    from_files, from_list = run_actions(a, plan), run_actions(b, plan)
    assert (
        from_files[0][4]["gamefile"].endswith("game.tw-pddl")
        and from_list[0][4]["gamefile"] is None
    )
    for row in from_files + from_list:
        del row[4]["gamefile"]  # where the game came from; everything else is the same
    assert from_files == from_list
    a.close()
    b.close()


def _walk(env, rng, n):
    _, info = env.reset(options={"problem": 3})
    actions = []
    for _ in range(n):
        a = info["admissible_actions"][int(rng.integers(len(info["admissible_actions"])))]
        _, _, terminated, _, info = env.step(a)
        actions.append(a)
        if terminated:
            break
    return actions, info


def _model(actions, **kwargs):
    m = gym.make(ID, **kwargs)
    m.reset(options={"problem": 3})
    for a in actions:
        m.step(a)
    return m


# ------------------------------------------------------------------ snapshots


@needs_engine
@pytest.mark.parametrize("mode", ["auto", "portable"])
def test_check_env_passes_on_both_snapshot_paths(mode):
    report = check_env(lambda: gym.make(ID, snapshot_mode=mode), seed=2)
    assert report.ok, str(report)


@needs_engine
def test_auto_mode_takes_the_fast_path_in_place_and_the_portable_one_elsewhere(env):
    rng = np.random.default_rng(0)
    _walk(env, rng, 6)
    other = gym.make(ID)
    other.reset(seed=5)
    with env.snapshot() as snap:
        assert snap.kind == "pddl+fast" and snap.picklable
        env.step("look")
        env.restore(snap)
        other.restore(snap)
        third = gym.make(ID)
        third.reset(seed=9)
        third.restore(pickle.loads(pickle.dumps(snap)))
    assert env.unwrapped.restore_counts == {"fast": 1}
    assert other.unwrapped.restore_counts == {"portable": 1}
    assert other.unwrapped.engine.last_portable_route == "sas"
    assert third.unwrapped.restore_counts == {"portable": 1}
    assert env.state_digest() == other.state_digest() == third.state_digest()
    other.close()
    third.close()


@needs_engine
def test_fast_path_survives_resets_and_falls_back_after_a_reload(env):
    rng = np.random.default_rng(1)
    actions, _ = _walk(env, rng, 5)
    snap = env.snapshot()
    digest = env.state_digest()
    env.reset(options={"problem": 3})  # same game: its task stays loaded, ids stay valid
    env.restore(snap)
    assert env.unwrapped.restore_counts == {"fast": 1} and env.state_digest() == digest
    env.reset(options={"problem": 4})  # another game: the library loads another task
    env.restore(snap)
    assert env.unwrapped.restore_counts == {"fast": 1, "portable": 1}
    assert env.state_digest() == digest
    model = _model(actions)
    assert run_actions(env, ["look", "inventory"]) == run_actions(model, ["look", "inventory"])
    model.close()
    snap.release()


@needs_engine
@pytest.mark.parametrize("mode", ["auto", "portable"])
def test_pickling_after_the_env_moved_on_to_another_game(mode):
    env = gym.make(ID, snapshot_mode=mode)
    _walk(env, np.random.default_rng(4), 5)
    digest = env.state_digest()
    snap = env.snapshot()
    env.reset(options={"problem": 9})  # the snapshot's game is no longer loaded here
    other = gym.make(ID)
    other.reset(seed=0)
    other.restore(pickle.loads(pickle.dumps(snap)))
    assert other.state_digest() == digest
    env.close()
    other.close()


@needs_engine
@pytest.mark.parametrize("mode", ["auto", "portable", "portable-pddl", "replay"])
def test_restored_states_play_exactly_like_replayed_ones(mode):
    """Random walks, snapshots at random depths, restored into the same and other instances."""
    rng = np.random.default_rng(42)
    kind = mode.split("-")[0]
    env = gym.make(ID, snapshot_mode=kind, max_episode_steps=200)
    sibling = gym.make(ID, snapshot_mode=kind, max_episode_steps=200)
    for e in (env, sibling):  # portable-pddl: rebuild a PDDL problem and translate it
        e.unwrapped.engine.prefer_sas = mode != "portable-pddl"
    sibling.reset(seed=1)
    for trial in range(2):
        prefix, _ = _walk(env, rng, int(rng.integers(3, 12)))
        snap = env.snapshot()
        future = _walk_future(env, rng, 6)
        model = _model(prefix, max_episode_steps=200)
        want = run_actions(model, future)
        model.close()
        for target in (env, sibling):
            obs, _ = target.restore(snap)
            assert run_actions(target, future) == want, (mode, trial)
        snap.release()
    assert sum(env.unwrapped.restore_counts.values()) == 2
    if kind == "portable":
        route = "pddl" if mode == "portable-pddl" else "sas"
        assert sibling.unwrapped.engine.last_portable_route == route
    env.close()
    sibling.close()


def _walk_future(env, rng, n):
    # Choose future actions on a copy so the live env is left where it is.
    probe = gym.make(ID, max_episode_steps=200)
    probe.reset(options={"problem": 3})
    with env.snapshot() as s:
        probe.restore(s)
    info = {"admissible_actions": probe.unwrapped.engine.state["admissible_commands"]}
    out = []
    for _ in range(n):
        a = info["admissible_actions"][int(rng.integers(len(info["admissible_actions"])))]
        _, _, terminated, _, info = probe.step(a)
        out.append(a)
        if terminated:
            break
    probe.close()
    return out


@needs_engine
def test_siblings_restored_from_one_snapshot_do_not_interfere():
    """K live instances from one snapshot, stepped differently and interleaved."""
    rng = np.random.default_rng(7)
    root = gym.make(ID, max_episode_steps=200)
    prefix, info = _walk(root, rng, 4)
    snap = root.snapshot()
    siblings = [gym.make(ID, max_episode_steps=200) for _ in range(3)]
    for k, s in enumerate(siblings):
        s.reset(seed=100 + k)
        s.restore(snap)
    actions = info["admissible_actions"]
    branches = [[actions[(k * 3 + j) % len(actions)] for j in range(5)] for k in range(4)]
    got = [[] for _ in range(4)]
    for j in range(5):  # interleave: every instance steps once per round
        for k, e in enumerate([root, *siblings]):
            if j < len(branches[k]):
                got[k].append(run_actions(e, [branches[k][j]]))
    for k in range(4):
        model = _model(prefix, max_episode_steps=200)
        want = run_actions(model, branches[k])
        model.close()
        flat = [step for chunk in got[k] for step in chunk]
        assert flat == want[: len(flat)], f"branch {k}"
    assert all(s.unwrapped.restore_counts == {"portable": 1} for s in siblings)
    snap.release()
    for e in [root, *siblings]:
        e.close()


@needs_engine
def test_engines_are_isolated_from_each_other():
    """Two engines on different games, stepped alternately, match solo runs."""
    problems = load_problem_set("in_distribution")
    a, b = problems[10], problems[100]
    solo = {}
    for p in (a, b):
        e = engine_mod.Engine()
        e.load(p)
        e.reset()
        solo[p.name] = [e.step(c)[0].feedback for c in p.expert_plan]
        e.close()
    ea, eb = engine_mod.Engine(), engine_mod.Engine()
    ea.load(a)
    eb.load(b)
    ea.reset()
    eb.reset()
    got = {a.name: [], b.name: []}
    for i in range(max(len(a.expert_plan), len(b.expert_plan))):
        for e, p in ((ea, a), (eb, b)):
            if i < len(p.expert_plan):
                got[p.name].append(e.step(p.expert_plan[i])[0].feedback)
    assert got == solo
    ea.close()
    eb.close()


@needs_engine
def test_engine_matches_alfworlds_own_wrapping_of_pddlenv():
    """Same text, commands and wins as textworld's PddlEnv under alfworld's AlfredDemangler."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
    from textworld.envs.pddl import PddlEnv

    rng = np.random.default_rng(3)
    for problem in (
        load_problem_set("in_distribution")[60],
        load_problem_set("out_of_distribution")[0],
    ):
        ref = AlfredDemangler(PddlEnv(textworld.EnvInfos(admissible_commands=True, won=True)))
        with engine_mod._translator_argv():
            ref.load(problem.game())
            state = ref.reset()
        ours = gym.make(ID, problems=[problem], max_episode_steps=100)
        obs, info = ours.reset(options={"problem": 0})
        assert obs == state.feedback and info["admissible_actions"] == state["admissible_commands"]
        commands = list(problem.expert_plan[:-1])
        for _ in range(12):
            commands.insert(int(rng.integers(len(commands) + 1)), "bogus command")
        for c in commands:
            with engine_mod._translator_argv():
                state, score, done = ref.step(c)
            obs, reward, terminated, _, info = ours.step(c)
            assert obs == state.feedback, c
            assert info["admissible_actions"] == state["admissible_commands"]
            assert (info["won"], reward, terminated) == (state["won"], float(score), done)
        ours.close()
        fast_downward_lib = ref._wrapped_env.downward_lib
        fast_downward_lib.cleanup()


@needs_engine
def test_parse_cache_does_not_change_play():
    problem = load_problem_set("out_of_distribution")[40]
    runs = []
    for enabled in (False, True):
        engine_mod.set_parse_cache(enabled)
        e = gym.make(ID, problems=[problem], max_episode_steps=100)
        e.reset(options={"problem": 0})
        runs.append(run_actions(e, ["look", "inventory", *problem.expert_plan]))
        e.close()
    engine_mod.set_parse_cache(True)
    assert runs[0] == runs[1] and runs[0][-1][2] is True


@needs_engine
def test_portable_snapshots_are_small_and_corruption_is_typed(env):
    _walk(env, np.random.default_rng(5), 8)
    with env.snapshot() as snap:
        data = snap.to_bytes()
    assert len(data) < 8_000
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0xFF
    with pytest.raises(SnapshotCorruptError):
        branchgym.Snapshot.from_bytes(bytes(damaged))
    other = gym.make(ID, problems="out_of_distribution")
    other.reset(seed=0)
    with pytest.raises(SnapshotMismatchError):
        other.restore(branchgym.Snapshot.from_bytes(data))
    other.close()
    # A payload that decodes but describes no state of this env.
    bogus = env.unwrapped._new_snapshot({"not": "an alfworld state"})
    with pytest.raises(SnapshotCorruptError, match="not a saved ALFWorld state"):
        env.unwrapped.restore(bogus)


@needs_engine
def test_foreign_states_are_not_loaded_into_the_games_task():
    """A state that is not one of the task's falls back to translating a rebuilt problem."""
    a, b = load_problem_set("in_distribution")[:2]
    engine = engine_mod.Engine()
    try:
        engine.load(b)
        engine.reset()
        foreign = engine.current_facts()
        engine.load(a)
        engine.reset()
        static = engine._static
        assert static.sas.at(engine_mod._atom_keys(foreign), static.static_atoms) is None
        own = engine_mod._atom_keys(engine.current_facts())
        assert static.sas.at(own, static.static_atoms) is not None
    finally:
        engine.close()


@needs_engine
def test_library_copies_are_pooled_not_leaked():
    before = engine_mod.loaded_library_copies()
    for _ in range(5):
        e = gym.make(ID)
        e.reset(seed=0)
        e.close()
    assert engine_mod.loaded_library_copies() - before <= 1


def test_missing_engine_says_how_to_install(monkeypatch):
    monkeypatch.setattr(engine_mod, "_import_engine", lambda: None)
    with pytest.raises(DependencyMissingError, match="--no-deps alfworld==0.4.2"):
        engine_mod.require_engine()


# ------------------------------------------------------------------ expert and play


def _expert_solves(problem):
    from branchgym.envs.alfworld.expert import solve

    env = gym.make(ID, problems=[problem], max_episode_steps=60)
    try:
        return solve(env, 0)
    finally:
        env.close()


def _first_of_each_type():
    out = []
    for split in ("in_distribution", "out_of_distribution"):
        problems = load_problem_set(split)
        for task_type in TASK_TYPES:
            out.append((split, next(i for i, p in enumerate(problems) if p.task_type == task_type)))
    return out


# The default run: the first problem of each task type in each set (12 games); the slow
# test below plays all 274.
SAMPLE = _first_of_each_type()


@needs_engine
@pytest.mark.parametrize("split,index", SAMPLE)
def test_planner_expert_solves_shipped_problems(split, index):
    problem = load_problem_set(split)[index]
    result = _expert_solves(problem)
    assert result.won and result.steps == len(problem.expert_plan)


@needs_engine
@pytest.mark.slow
def test_planner_expert_solves_every_shipped_problem():
    # 274 games at about 0.4 s of planning each: split over two processes (CI has two
    # cores, and the suite uses one).
    import concurrent.futures
    import multiprocessing

    games = [
        (split, i)
        for split in ("in_distribution", "out_of_distribution")
        for i in range(len(load_problem_set(split)))
    ]
    halves = [games[0::2], games[1::2]]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        failed = [name for names in pool.map(_unsolved, halves) for name in names]
    assert not failed


def _unsolved(games):
    """Names of the shipped games of ``games`` ((split, index) pairs) the expert loses."""
    import branchgym  # noqa: F401  (registers the env in this worker)

    return [
        problem.name
        for problem in (load_problem_set(split)[i] for split, i in games)
        if not _expert_solves(problem).won
    ]


@needs_engine
def test_play_alfworld_in_the_terminal():
    from branchgym.cli import play

    out = io.StringIO()
    script = "go to sinkbasin 1\n:snap\nlook\n:restore 0\n:actions\nwhatever\n:quit\n"
    assert play(ID, seed=0, stdin=io.StringIO(script), stdout=out) == 0
    text = out.getvalue()
    assert "Your task is to:" in text and "snapshot 0 at step 1 (pddl+fast" in text
    assert "restored snapshot 0 (step 1)" in text and "Nothing happens." in text
    assert "inventory" in text  # :actions listed the admissible commands


@needs_engine
def test_alfworld_command_solves_and_generates(tmp_path, capsys):
    from branchgym.cli import main

    assert main(["alfworld", "solve", "out_of_distribution", "--limit", "3"]) == 0
    assert "task type" in capsys.readouterr().out
    out = tmp_path / "gen.jsonl.gz"
    assert main(["alfworld", "generate", "--n", "2", "--seed", "4", "--out", str(out)]) == 0
    assert len(load_problems(out)) == 2


# ------------------------------------------------------------------ ALFWorld's real data layout


def _upstream_tree(tmp_path):
    """json_2.1.1 with good trials and one of each kind ALFWorld skips."""
    from branchgym.envs.alfworld.problems import export_tw_pddl

    root = tmp_path / "json_2.1.1"
    problems = load_problem_set("in_distribution")
    good = {"valid_seen": problems[:3], "train": problems[3:5]}
    for split, ps in good.items():
        for p in ps:
            export_tw_pddl(dataclasses.replace(p, name=f"{p.name}/trial_T0001"), root / split)
    seen = root / "valid_seen"

    def trial(name, task_type, game):
        d = seen / name / "trial_T0002"
        d.mkdir(parents=True)
        (d / "traj_data.json").write_text(json.dumps({"task_type": task_type}))
        if game is not None:
            (d / "game.tw-pddl").write_text(json.dumps(game))
        return d

    base = problems[0].game()
    skipped = {
        "movable_or_sliced": [
            trial(
                "pick_and_place_with_movable_recep-Pen-Bowl-Desk-1",
                "pick_and_place_simple",
                {**base, "solvable": True},
            ),
            trial(
                "pick_heat_then_place_in_recep-AppleSliced-None-Fridge-2",
                "pick_heat_then_place_in_recep",
                {**base, "solvable": True},
            ),
        ],
        "task_type": [
            trial("look_at_obj-Book-None-Lamp-3", "look_at_obj", {**base, "solvable": True})
        ],
        "missing_game": [
            trial("pick_and_place_simple-Mug-None-Shelf-4", "pick_and_place_simple", None)
        ],
        "missing_solvable": [
            trial("pick_and_place_simple-Cup-None-Shelf-5", "pick_and_place_simple", base)
        ],
        "unsolvable": [
            trial(
                "pick_and_place_simple-Egg-None-Sink-6",
                "pick_and_place_simple",
                {**base, "solvable": False},
            )
        ],
    }
    # a folder without traj_data.json is not a trial at all
    (seen / "README").mkdir()
    (seen / "README" / "game.tw-pddl").write_text(json.dumps({**base, "solvable": True}))
    return root, good, skipped


def test_real_data_is_filtered_and_ordered_as_alfworld_does(tmp_path):
    from branchgym.envs.alfworld.dataset import collect_game_files, load_split

    root, good, skipped = _upstream_tree(tmp_path)
    files = collect_game_files(root, "valid_seen")
    # ALFWorld's own walk: bottom-up os.walk, trial folders with traj_data.json, in that order
    walk = [d for d, _, f in os.walk(root / "valid_seen", topdown=False) if "traj_data.json" in f]
    kept = [str(g.parent) for g in files.games]
    assert kept == [d for d in walk if d in kept]
    assert sorted(g.parent.parent.name for g in files.games) == sorted(
        p.name for p in good["valid_seen"]
    )
    assert {k: sorted(v) for k, v in files.skipped.items()} == {
        k: sorted(v) for k, v in skipped.items()
    }
    problems = load_split(root, "valid_seen", order="sorted")
    assert [p.gamefile for p in problems] == sorted(str(g) for g in files.games)
    assert all(p.split == "valid_seen" for p in problems)
    train = load_split(root, "train")
    assert sorted(p.goal for p in train) == sorted(p.goal for p in good["train"])
    assert len(load_split(root, "valid_seen", num_games=2)) == 2
    only = load_split(root, "valid_seen", task_types=[good["valid_seen"][0].task_type])
    assert {p.task_type for p in only} == {good["valid_seen"][0].task_type}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split": "test"}, "choose one of"),
        ({"split": "valid_unseen"}, "has no valid_unseen/ folder"),
        ({"task_types": [9]}, "unknown ALFWorld task type"),
        ({"order": "random"}, "choose 'upstream' or 'sorted'"),
    ],
)
def test_real_data_mistakes_are_typed_errors(tmp_path, kwargs, match):
    from branchgym.envs.alfworld.dataset import collect_game_files

    root, _, _ = _upstream_tree(tmp_path)
    with pytest.raises(DataError, match=match):
        collect_game_files(root, **kwargs)
    with pytest.raises(DataError, match="point it at json_2.1.1"):
        collect_game_files(tmp_path / "nowhere")
    with pytest.raises(DataError, match="no playable ALFWorld game"):
        collect_game_files(root, "valid_seen", task_types=[2, 6])


@needs_engine
def test_the_env_plays_alfworld_real_data_with_its_gamefile_in_info(tmp_path):
    root, good, _ = _upstream_tree(tmp_path)
    env = gym.make(ID, data_dir=str(root), split="valid_seen", game_order="sorted")
    _, info = env.reset(options={"problem": 0})
    assert info["gamefile"].endswith("game.tw-pddl") and str(root) in info["gamefile"]
    plan = next(p for p in good["valid_seen"] if p.goal == info["task"]).expert_plan
    *_, (obs, reward, term, _, info) = [env.step(a) for a in plan]
    assert reward == 1.0 and term and info["won"]
    env.close()
    with pytest.raises(DataError, match="either problems= or data_dir="):
        gym.make(ID, problems="out_of_distribution", data_dir=str(root))
    with pytest.raises(DataError, match="give data_dir="):
        gym.make(ID, split="valid_seen")


# ------------------------------------------------------------------ real AI2-THOR floor plans


@needs_engine
def test_rooms_come_from_the_real_floor_plans():
    import alfworld

    from branchgym.envs.alfworld import floorplans
    from branchgym.envs.alfworld.problems import mangle

    raw = json.loads(
        (
            __import__("pathlib").Path(alfworld.__file__).parent
            / "gen/layouts/FloorPlan1-openable.json"
        ).read_text()
    )
    lay = floorplans.floor_plan_layout(1)
    assert lay.room == "Kitchen" and lay.name == "FloorPlan1"
    ids = {rid for _, rid, _ in lay.instances}
    # every walk-to receptacle of the scene is there under its real THOR id
    assert {k for k in raw if not k.startswith("Sink|")} <= ids
    assert any(r.startswith("Sink|") and r.endswith("|SinkBasin") for r in ids)
    assert len(lay.receptacles) >= len(raw) and lay.receptacles.count("Cabinet") == 8
    assert {"Apple", "Mug", "Knife"} <= set(lay.objects) and "Cabinet" not in lay.objects
    assert floorplans.floor_plans("thor_unseen") == (10, 219, 308, 424)
    seen = floorplans.floor_plans("thor_seen")
    assert not set(seen) & {10, 219, 308, 424, 1, 2, 3, 4, 5, 6}
    assert {floorplans.room_of(n) for n in seen} == {"Kitchen", "LivingRoom", "Bedroom", "Bathroom"}
    kitchens = [len(floorplans.floor_plan_layout(n).receptacles) for n in seen if n < 100]
    assert min(kitchens) >= 12 and max(kitchens) >= 30  # real kitchens, not 4-12
    problem = generate_problem(lay, "pick_heat_then_place_in_recep", 0)
    assert problem.expert_plan and mangle(next(iter(sorted(raw)))) in problem.pddl_problem


@needs_engine
@pytest.mark.parametrize("split", ["thor_seen", "thor_unseen"])
def test_shipped_thor_sets_are_on_their_floor_plans_with_alfworlds_task_mix(split):
    from branchgym.envs.alfworld import floorplans

    problems = load_problem_set(split)
    counts = tuple(sum(p.task_type == t for p in problems) for t in TASK_TYPES)
    assert counts == SPLIT_TASK_COUNTS[split]
    plans = {int(p.layout.removeprefix("FloorPlan")) for p in problems}
    assert plans <= set(floorplans.floor_plans(split))
    if split == "thor_unseen":
        assert plans == set(floorplans.UNSEEN_FLOOR_PLANS)
    assert all(p.expert_plan for p in problems)
    stats = floorplans.set_statistics(problems)
    assert stats["receptacles_by_room"]["Kitchen"]["mean"] >= 15
    # hand-written rooms are grouped by their room type too, so the sets compare
    hand = floorplans.set_statistics(load_problem_set("in_distribution"))["receptacles_by_room"]
    assert set(hand) == {"Kitchen", "LivingRoom", "Bedroom", "Bathroom"}
    assert hand["Kitchen"]["max"] <= 12 < stats["receptacles_by_room"]["Kitchen"]["max"]
