"""FleetExecutor.on_ray: the servers as Ray actors (a local Ray, loopback only)."""

import pytest

pytest.importorskip("openenv")
ray = pytest.importorskip("ray")

from branchgym.agents.policies.policy import TextPolicy  # noqa: E402
from branchgym.rollout.executor_base import EnvRecipe  # noqa: E402
from branchgym.rollout.fleet import FleetExecutor  # noqa: E402
from branchgym.rollout.grow import grow_tree  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fleet_of_ray_actor_servers_grows_the_in_process_tree():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        spec = EnvRecipe("branchgym/TextTreeMDP-v0", {"transition_noise": 0.5})
        fleet = FleetExecutor.on_ray(spec.id, 2, env_kwargs=spec.kwargs, host="127.0.0.1")
        try:
            assert len(fleet.servers) == 2
            assert all(u.startswith("ws://127.0.0.1:") for u in fleet.servers)
            kw = {"m": 2, "k": 4, "seed": 0, "rng": 3, "schedule_options": {"gap_unit": "steps"}}
            got = grow_tree(spec, TextPolicy(), "entropy", executor=fleet, **kw)
            want = grow_tree(spec, TextPolicy(), "entropy", **kw)
            summary = [(n.parent, n.action, n.observation, n.reward, n.done) for n in want]
            assert [(n.parent, n.action, n.observation, n.reward, n.done) for n in got] == summary
            assert got.stats.errors == 0
        finally:
            fleet.shutdown()
    finally:
        ray.shutdown()
