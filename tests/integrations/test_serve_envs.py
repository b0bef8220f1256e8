"""check_env and the fidelity suite on RemoteEnv for the shipped envs, served on loopback."""

import functools

import pytest

pytest.importorskip("openenv")
pytest.importorskip("websockets")

from branchgym.fidelity.checks import check_env  # noqa: E402
from branchgym.fidelity.suite import check_snapshot_fidelity  # noqa: E402
from branchgym.remote import RemoteEnv  # noqa: E402
from branchgym.serve.process import ServerProcess  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "env-token"


def _swebench_kwargs():
    from branchgym.envs.swebench.generated import generated_tasks

    return {"backend": "overlay", "instance_ids": [generated_tasks()[0].instance_id]}


CASES = {
    "webshop": ("branchgym/WebShop-v0", dict, 12, 25),
    "alfworld": ("branchgym/ALFWorld-v0", dict, 6, 15),
    "swebench-overlay": ("branchgym/SWEBench-v0", _swebench_kwargs, 4, 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_env_and_fidelity_pass_on_a_served_env(case):
    env_id, kwargs, max_examples, steps = CASES[case]
    if case.startswith("swebench"):
        from branchgym.envs.swebench.mounts import overlay_support

        ok, why = overlay_support()
        if not ok:
            pytest.skip(f"no overlay mounts on this machine: {why}")
    with ServerProcess(env_id, kwargs(), token=TOKEN) as server:
        factory = functools.partial(RemoteEnv, server.url, token=TOKEN)
        report = check_env(factory, seed=0)
        assert report.ok, str(report)
        fidelity = check_snapshot_fidelity(
            factory, max_examples=max_examples, steps=steps, seed=2, shrink_seconds=0
        )
        assert fidelity.ok, str(fidelity)
        assert fidelity.restores > 0
        probe = factory()
        try:
            stats = probe.stats()
        finally:
            probe.close()
        assert stats["snapshots"] == 0  # every snapshot of the checks was released there
