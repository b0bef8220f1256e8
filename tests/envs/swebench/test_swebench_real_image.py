"""SWE-bench's own images as the docker backend's primary path, end to end.

The image is built offline from tests/envs/swebench/data/images/ in the harness's layout
(the repository at /testbed at the base commit plus the setup commit "SWE-bench", an
/opt/miniconda3/bin/activate with a `testbed` environment) and named as the swebench
package names published images (``swebench/sweb.eval.x86_64.<id, __ as _1776_>:latest``).
It is kept between runs and rebuilt only when its inputs change.
"""

import dataclasses
import re
import shutil
import tempfile
from pathlib import Path

import gymnasium as gym
import pytest

from branchgym.digest import stable_hash
from branchgym.envs.swebench.grading import working_tree_patch
from branchgym.envs.swebench.sandbox import tree_digest
from branchgym.error import DataError, SandboxUnavailableError

DATA = Path(__file__).parent / "data" / "images"
ENV_ID = "branchgym/SWEBench-v0"
#: Another id than the generated task's, so the other Docker tests never find this image.
FIXTURE_ID = "swebench-fixture__lrucache-1"


def test_image_names_are_the_packages():
    pytest.importorskip("swebench")
    from swebench.task.checks import expected_image

    from branchgym.envs.swebench.docker_backend import swebench_image_names
    from branchgym.envs.swebench.generated import generated_tasks

    task = dataclasses.replace(generated_tasks()[0], instance_id="django__django-11099")
    names = swebench_image_names(task)
    assert names == [
        "swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
        "sweb.eval.x86_64.django__django-11099:latest",
    ]
    assert names[0] == expected_image("django__django-11099")
    row = dataclasses.replace(task, extra={"image": "mirror.local/sweb.eval.x86_64.x:v1"})
    assert swebench_image_names(row)[0] == "mirror.local/sweb.eval.x86_64.x:v1"
    assert swebench_image_names(task, namespace="mine")[0].startswith("mine/sweb.eval.")


def build_fixture_image(client, task, checkout: Path) -> str:
    """Build (or find, unchanged) the SWE-bench-layout image of ``task``; returns its name."""
    from swebench.image_builder.image_spec import ImageSpec

    from branchgym.envs.swebench.docker_backend import BASE_IMAGE, SWEBENCH_NAMESPACE

    dockerfile = (DATA / "Dockerfile").read_text()
    name = ImageSpec(task.instance_id, dockerfile, namespace=SWEBENCH_NAMESPACE).name
    files = {p.name: p.read_bytes() for p in sorted(DATA.iterdir())}
    base = client.images.get(BASE_IMAGE).id
    key = stable_hash("fixture-image", files, base, task.base_commit, tree_digest(checkout))
    try:
        if client.images.get(name).labels.get("branchgym.fixture") == key:
            return name
    except Exception:  # docker.errors.ImageNotFound
        pass
    with tempfile.TemporaryDirectory() as ctx:
        for fname, data in files.items():
            Path(ctx, fname).write_bytes(data)
        shutil.copytree(checkout, Path(ctx, "testbed"), symlinks=True)
        client.images.build(
            path=ctx,
            tag=name,
            buildargs={"BASE": BASE_IMAGE},
            labels={"branchgym.fixture": key},
            network_mode="none",  # offline: everything comes from the context
            rm=True,
            forcerm=True,
        )
    return name


@pytest.fixture(scope="module")
def fixture_task(docker_available, task_by_name, checkout):
    from branchgym.envs.swebench.docker_backend import docker_client

    task = task_by_name["lrucache"]
    fixture = dataclasses.replace(task, instance_id=FIXTURE_ID)
    build_fixture_image(docker_client(), fixture, checkout(task))
    return fixture


def owned():
    import os

    from branchgym.envs.swebench import docker_backend as db

    db.wait_idle()
    return db.owned_resources(pid=os.getpid())


@pytest.mark.docker
@pytest.mark.slow
def test_real_image_gold_resolves_wrong_does_not(fixture_task):
    task = fixture_task
    # No repos_dir: the image holds the repository.
    env = gym.make(ENV_ID, tasks=[task], backend="docker")
    try:
        env.reset(options={"instance_id": task.instance_id})
        # The image's environment: `testbed` activated, the image's ENV kept, its user.
        out = env.step(
            "echo $CONDA_DEFAULT_ENV; command -v python; "
            "python -c 'import sys; print(sys.prefix)'; echo $SWEBENCH_FIXTURE_IMAGE; "
            "id -u; git log -1 --format=%s; sleep 300 &"
        )[0]
        assert out.split("\n")[:6] == [
            "testbed",
            "/opt/miniconda3/envs/testbed/bin/python",
            "/opt/miniconda3/envs/testbed",
            "1",
            "0",
            "SWE-bench",
        ], out
        # The background sleep died with its command, and the container did not.
        assert env.step("cat /proc/[0-9]*/comm | grep -c '^sleep$'")[0].strip() == "1"

        sandbox = env.unwrapped.sandbox
        assert sandbox.base_ref != task.base_commit  # HEAD is the image's setup commit
        assert env.unwrapped.grade(task.extra["branchgym_wrong_patch"]).resolved is False

        with env.unwrapped.snapshot() as snap:
            env.step("echo junk >> lrucache/core.py; export MODE=x")
            env.unwrapped.restore(snap)
        assert env.step("git status --short; echo ${MODE:-unset}")[0] == "unset\n"

        env.step(task.extra["branchgym_fix_command"])
        # Against base_commit the diff drags the setup commit in, and `git apply` refuses
        # it in the image it is graded in (which already holds that change).
        dragged = working_tree_patch(sandbox, task.base_commit)
        assert "Installed into the testbed environment" in dragged
        fresh = env.unwrapped.backend.create(task, None)
        try:
            fresh.write("/testbed/dragged.diff", dragged.encode())
            assert fresh.exec("git apply --check dragged.diff").exit_code != 0
        finally:
            fresh.close()

        obs, reward, terminated, _, info = env.step("submit")
        assert reward == 1.0 and terminated, obs
        assert info["patch"] == task.patch
    finally:
        env.close()
    assert owned() == {"containers": [], "images": []}


@pytest.mark.docker
def test_missing_image_says_how_to_load_it(docker_available, task_by_name):
    task = dataclasses.replace(task_by_name["lrucache"], instance_id="nowhere__repo-1")
    env = gym.make(ENV_ID, tasks=[task], backend="docker", docker_image="swebench")
    try:
        with pytest.raises(SandboxUnavailableError, match="docker load"):
            env.reset(options={"instance_id": task.instance_id})
    finally:
        env.close()
    # auto: no image and no clone either.
    env = gym.make(ENV_ID, tasks=[task], backend="docker")
    try:
        with pytest.raises(DataError, match="repos_dir"):
            env.reset(options={"instance_id": task.instance_id})
    finally:
        env.close()


@pytest.mark.docker
@pytest.mark.slow
def test_check_env_on_a_real_image(fixture_task):
    """Snapshots of a SWE-bench image restore in another instance with its user and env."""
    from branchgym.envs.swebench.env import PROBE_ACTIONS
    from branchgym.fidelity.checks import check_env

    report = check_env(
        lambda: gym.make(
            ENV_ID, tasks=[fixture_task], backend="docker", suggested_actions=PROBE_ACTIONS
        ),
        seed=2,
        checks=("round_trip", "independence", "portability", "release"),
    )
    assert report.ok, str(report)
    assert owned() == {"containers": [], "images": []}


@pytest.mark.docker
def test_registry_mirror_template(fixture_task):
    from branchgym.envs.swebench.docker_backend import docker_client, swebench_image_names

    client = docker_client()
    published = swebench_image_names(fixture_task)[0]
    mirror = f"mirror.invalid:5000/{published}"
    repo, _, tag = mirror.rpartition(":")

    def make():
        template = "mirror.invalid:5000/{image}"
        return gym.make(ENV_ID, tasks=[fixture_task], backend="docker", docker_image=template)

    env = make()
    try:
        with pytest.raises(SandboxUnavailableError, match=re.escape(repr(mirror))):
            env.reset(options={"instance_id": fixture_task.instance_id})
    finally:
        env.close()
    client.images.get(published).tag(repo, tag)  # as `docker pull` from the mirror does
    env = make()
    try:
        env.reset(options={"instance_id": fixture_task.instance_id})
        assert env.step("echo $CONDA_DEFAULT_ENV")[0] == "testbed\n"
    finally:
        env.close()
        try:
            client.images.remove(mirror)
        except Exception:  # docker.errors.ImageNotFound: the tag failed
            pass


@pytest.mark.docker
def test_image_without_its_testbed_env_is_refused(fixture_task):
    from branchgym.envs.swebench.docker_backend import docker_client, swebench_image_names
    from branchgym.error import SandboxError

    client = docker_client()
    c = client.containers.create(
        swebench_image_names(fixture_task)[0],
        ["rm", "-rf", "/opt/miniconda3/envs/testbed"],
        network_mode="none",
    )
    try:
        c.start()
        c.wait()
        c.commit(repository="branchgym-test/no-testbed", tag="latest")
    finally:
        c.remove(force=True)
    env = gym.make(
        ENV_ID,
        tasks=[fixture_task],
        backend="docker",
        docker_image="branchgym-test/no-testbed:latest",
    )
    try:
        with pytest.raises(SandboxError, match="conda activate testbed` failed"):
            env.reset(options={"instance_id": fixture_task.instance_id})
    finally:
        env.close()
        left = owned()  # waits for the background removal of the refused container
        client.images.remove("branchgym-test/no-testbed:latest")
    assert left == {"containers": [], "images": []}


@pytest.mark.docker
def test_snapshot_images_forget_how_they_ran_once_released(fixture_task):
    from branchgym.envs.swebench import docker_backend as db
    from branchgym.envs.swebench import docker_sandbox

    backend = db.DockerBackend()
    infos = docker_sandbox.IMAGE_INFO[id(backend.client)]
    sb = backend.create(fixture_task, None)
    try:
        before = len(infos)
        snap = sb.snapshot()
        assert infos[snap.image_id].user == "0:0" and len(infos) == before + 1
        child = sb.fork(snap)
        assert child.exec("id -u; echo $CONDA_DEFAULT_ENV").text == "0\ntestbed\n"
        child.close()
        snap.release()
        db.wait_idle()
        assert len(infos) == before
    finally:
        sb.close()
    assert owned() == {"containers": [], "images": []}


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["docker-git", "docker-overlay"])
def test_testbed_only_modes_on_a_real_image(fixture_task, backend):
    # docker-overlay copies /testbed out of the image (root's, with its setup commit) as
    # the bottom layer, and runs the image's conda environment on a read-only root.
    task = fixture_task
    env = gym.make(ENV_ID, tasks=[task], backend=backend)
    try:
        env.reset(options={"instance_id": task.instance_id})
        digest = env.unwrapped.state_digest()
        with env.unwrapped.snapshot() as snap:
            env.step("echo junk >> lrucache/core.py; mkdir -p made/here; git commit -qam junk")
            env.unwrapped.restore(snap)
        assert env.unwrapped.state_digest() == digest
        assert env.step("git log -1 --format=%s; echo $CONDA_DEFAULT_ENV")[0] == (
            "SWE-bench\ntestbed\n"
        )
        env.step(task.extra["branchgym_fix_command"])
        obs, reward, _, _, info = env.step("submit")
        assert reward == 1.0 and info["patch"] == task.patch, obs
    finally:
        env.close()
    assert owned() == {"containers": [], "images": []}
