"""Session fixtures of the SWE-bench tests: one task set, one checkout per task, shared backends."""

import hashlib
import os

import pytest

from branchgym.envs.swebench.generated import (
    generated_repos,
    generated_tasks,
    realistic_repos,
    realistic_tasks,
)
from branchgym.envs.swebench.local import LocalBackend
from branchgym.envs.swebench.tasks import SWEBenchTask, ensure_checkout
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


@pytest.fixture(scope="session")
def real_tasks():
    """The realistic task set (real PyPI projects)."""
    return realistic_tasks()


@pytest.fixture(scope="session")
def real_checkout():
    """``task`` -> its pristine checkout (a realistic task)."""
    repos = realistic_repos()
    return lambda task: ensure_checkout(task, repos)


@pytest.fixture
def needy_project(tmp_path):
    """``requires`` -> (task, folder) of an installable project that declares it.

    Its version names ``requires`` (environments are keyed by repository and version: a
    project whose dependency is missing never meets the built environment of another).
    """

    def make(requires):
        tag = hashlib.sha256(requires.encode()).hexdigest()[:8]
        proj = tmp_path / f"needy-{tag}"
        (proj / "needy").mkdir(parents=True)
        (proj / "needy" / "__init__.py").write_text("")
        (proj / "setup.py").write_text(
            "from setuptools import setup\n"
            "setup(name='needy', version='1.0', packages=['needy'],\n"
            f"      install_requires=[{requires!r}])\n"
        )
        task = SWEBenchTask(
            instance_id="octo__needy-1", repo="octo/needy", base_commit="a" * 40,
            problem_statement="", patch="", test_patch="", fail_to_pass=(), pass_to_pass=(),
            version=f"1.0+{tag}",
        )  # fmt: skip
        return task, proj

    return make


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
