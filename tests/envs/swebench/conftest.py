"""Session fixtures of the SWE-bench tests: one task set, one checkout per task, shared backends."""

import os

import pytest

from branchgym.envs.swebench.generated import generated_repos, generated_tasks
from branchgym.envs.swebench.local import LocalBackend
from branchgym.envs.swebench.tasks import ensure_checkout
from branchgym.error import DependencyMissingError, SandboxUnavailableError


@pytest.fixture(scope="session")
def tasks():
    return generated_tasks()


@pytest.fixture(scope="session")
def task_by_name(tasks):
    return {t.repo.split("/")[1]: t for t in tasks}


@pytest.fixture
def host_victim(tmp_path):
    """A host file (``<tmp>/outside/victim``, text "v") that links planted in a sandbox name."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_text("v")
    return victim


@pytest.fixture(scope="session")
def checkout(tasks):
    repos = generated_repos()
    return lambda task: ensure_checkout(task, repos)


@pytest.fixture(scope="session", params=["overlay", "git"])
def local_backend(request):
    return LocalBackend(request.param)


@pytest.fixture(scope="session")
def overlay_backend():
    return LocalBackend("overlay")


@pytest.fixture
def sandbox(local_backend, task_by_name, checkout):
    task = task_by_name["textstats"]
    sb = local_backend.create(task, checkout(task))
    yield sb
    sb.close()


@pytest.fixture(scope="session")
def docker_available():
    """Skip without Docker and its base image (fail with BRANCHGYM_REQUIRE_DOCKER=1, as CI)."""
    try:
        from branchgym.envs.swebench.docker_backend import BASE_IMAGE, docker_client

        docker_client().images.get(BASE_IMAGE)
    except (DependencyMissingError, SandboxUnavailableError, ImportError) as exc:
        reason = f"no Docker here: {exc}"
    except Exception as exc:  # docker.errors.ImageNotFound
        reason = f"base image missing (scripts/swebench_docker_image.sh): {exc}"
    else:
        return
    if os.environ.get("BRANCHGYM_REQUIRE_DOCKER") == "1":
        pytest.fail(f"CI expects Docker (BRANCHGYM_REQUIRE_DOCKER=1) but: {reason}")
    pytest.skip(reason)


#: Every sandbox backend, Docker's marked (the escape and reward-hack suites run on each).
EVERY_BACKEND = [
    "overlay",
    "git",
    pytest.param("docker", marks=pytest.mark.docker),
    pytest.param("docker-git", marks=pytest.mark.docker),
    pytest.param("docker-overlay", marks=pytest.mark.docker),
]


@pytest.fixture(scope="module", params=EVERY_BACKEND)
def backend_name(request):
    """A backend of :data:`EVERY_BACKEND`; Docker's only where Docker and its image are."""
    if request.param.startswith("docker"):
        request.getfixturevalue("docker_available")
    return request.param
