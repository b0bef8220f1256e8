"""Each repository's environment on the Docker backends (docker_env.py); parity with local.

Against a real daemon (scripts/with_docker.sh starts one and builds the base image); with
BRANCHGYM_REQUIRE_DOCKER=1 a missing daemon or image fails these tests instead of
skipping them.
"""

import hashlib
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from branchgym.envs.swebench.grading import grade
from branchgym.envs.swebench.local import LocalBackend
from branchgym.error import RepoEnvironmentError

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "swebench_docker_image.sh"


def test_base_image_name_changes_with_the_scripts_package_list():
    # A machine (CI's) that built the image from an older package list keeps it, and its
    # rootfs tarball, under the old name: the new list must name a new image.
    from branchgym.envs.swebench import docker_backend

    text = SCRIPT.read_text()
    (packages,) = re.findall(r'^PACKAGES="([^"]+)"$', text, flags=re.M)
    digest = hashlib.sha256(packages.encode()).hexdigest()[:8]
    assert docker_backend.BASE_PACKAGES_HASH == digest, (
        "scripts/swebench_docker_image.sh's PACKAGES changed: set BASE_PACKAGES_HASH in "
        f"docker_backend.py to {digest}"
    )
    assert {"python3-pip", "python3-tk", "python3-pytest"} <= set(packages.split(","))
    out = subprocess.run(
        ["bash", "-c", 'printf %s "$1" | sha256sum | cut -c1-8', "_", packages],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == digest  # the script's own hash, computed as it does
    assert (
        'IMAGE="${BRANCHGYM_DOCKER_IMAGE:-branchgym/swebench-base:$SUITE-$PACKAGES_HASH}"' in text
    )
    assert 'TARBALL="$CACHE/swebench-base-$SUITE-$PACKAGES_HASH.tar"' in text
    if "BRANCHGYM_DOCKER_IMAGE" not in os.environ:
        assert docker_backend.BASE_IMAGE == f"branchgym/swebench-base:bookworm-{digest}"


def _cachetools(real_tasks):
    return next(t for t in real_tasks if t.repo == "tkem/cachetools")


@pytest.mark.docker
@pytest.mark.slow
def test_env_image_is_built_once_and_installs_a_src_layout_at_testbed(
    docker_available, real_tasks, real_checkout
):
    from branchgym.envs.swebench.docker_backend import BASE_IMAGE, DockerBackend, docker_client
    from branchgym.envs.swebench.docker_env import env_image, env_image_name

    task = _cachetools(real_tasks)
    checkout = real_checkout(task)
    client = docker_client()
    base = client.images.get(BASE_IMAGE)
    first = env_image(client, base, task, checkout, BASE_IMAGE)
    created = client.images.get(first).attrs["Created"]
    assert env_image(client, base, task, checkout, BASE_IMAGE) == first  # reused, not rebuilt
    assert client.images.get(env_image_name(task, base.id)).attrs["Created"] == created
    # The task's image is built over it; its /testbed is the checkout, imported from
    # anywhere (the src/ layout through the install), tkinter there (six's tests import it).
    backend = DockerBackend()
    image = client.images.get(backend.task_image(task, checkout))
    assert first in {layer.get("Id") for layer in client.api.history(image.id)}
    sb = backend.create(task, checkout)
    try:
        res = sb.exec(
            "cd / && python3 -c 'import cachetools, tkinter; print(cachetools.__file__)' && "
            "id -u && git -C /testbed status --porcelain | wc -l"
        )
        assert res.exit_code == 0, res.text
        assert res.text.split() == ["/testbed/src/cachetools/__init__.py", "1000", "0"]
        # The agent cannot change the installed environment.
        res = sb.exec('d=$(echo /usr/local/lib/python3*/dist-packages) && touch "$d/x"')
        assert res.exit_code != 0 and "Permission denied" in res.text
    finally:
        sb.close()


@pytest.mark.docker
@pytest.mark.slow
def test_missing_dependency_or_pip_is_a_typed_error_naming_the_fix(docker_available, needy_project):
    from branchgym.envs.swebench.docker_backend import BASE_IMAGE, docker_client
    from branchgym.envs.swebench.docker_env import env_image, env_image_name

    client = docker_client()
    base = client.images.get(BASE_IMAGE)
    task, proj = needy_project("branchgym-no-such-distribution>=1")
    with pytest.raises(RepoEnvironmentError, match="branchgym-no-such-distribution.*PACKAGES"):
        env_image(client, base, task, proj, BASE_IMAGE)
    assert not client.images.list(name=env_image_name(task, base.id))  # nothing half-built
    # A dependency the image has (Debian's python3-pytest) is found.
    task, proj = needy_project("pytest")
    image = env_image(client, base, task, proj, BASE_IMAGE)
    try:
        # A base image without pip (one built from an older package list).
        c = client.containers.run(base.id, ["rm", "-rf", "/usr/lib/python3/dist-packages/pip"],
                                  detach=True)  # fmt: skip
        c.wait()
        nopip = c.commit()
        c.remove()
        try:
            with pytest.raises(RepoEnvironmentError, match="no pip.*swebench_docker_image.sh"):
                env_image(client, nopip, task, proj, "old-base")
        finally:
            client.images.remove(nopip.id, force=True)
    finally:
        client.images.remove(image, force=True)


# ---------------------------------------------------------------- parity with local


def _grade_all(backend, tasks, checkout_of, workers):
    """{(instance id, "gold"/"wrong"): report} with the defences on."""

    def run(job):
        task, which = job
        patch = task.patch if which == "gold" else task.extra["branchgym_wrong_patch"]
        sb = backend.create(task, checkout_of(task))
        try:
            return (task.instance_id, which), grade(sb, task, patch, timeout=300, guard=True)
        finally:
            sb.close()

    jobs = [(t, w) for t in tasks for w in ("gold", "wrong")]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(run, jobs))


@pytest.fixture(scope="module")
def local_reports(real_tasks, real_checkout):
    backend = LocalBackend()
    for task in real_tasks:  # environments first (once per repository and version)
        backend.runner_for(task, real_checkout(task))
    return _grade_all(backend, real_tasks, real_checkout, workers=2)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("name", ["docker", "docker-git", "docker-overlay"])
def test_realistic_tasks_grade_on_docker_as_on_local(
    docker_available, name, real_tasks, real_checkout, local_reports
):
    """Every realistic task: gold resolves, wrong does not, test by test as on local."""
    from branchgym.envs.swebench.docker_backend import DockerBackend

    backend = DockerBackend(snapshot_mode={"docker": "commit"}.get(name, name[len("docker-") :]))
    reports = _grade_all(backend, real_tasks, real_checkout, workers=3)
    assert reports.keys() == local_reports.keys() and len(reports) == 2 * len(real_tasks) >= 40
    problems = {}
    for (iid, which), report in sorted(reports.items()):
        local = local_reports[iid, which]
        if report.rejected or report.outcome_check != "pytest reports":
            problems[iid, which] = f"rejected={report.rejected!r} check={report.outcome_check!r}"
        elif report.resolved != (which == "gold") or report.resolved != local.resolved:
            problems[iid, which] = f"resolved={report.resolved}: {report.test_log[-800:]}"
        elif report.tests_status != local.tests_status:
            problems[iid, which] = f"{report.tests_status} != local {local.tests_status}"
    assert not problems, problems
