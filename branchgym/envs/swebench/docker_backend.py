"""Docker sandboxes (``docker`` extra): one container per sandbox, snapshots as images or git trees.

Snapshot modes:

* ``commit`` (kind ``container``): ``snapshot()`` is ``container.commit()`` (an image
  layer holding the container's changes; the container is not paused, since no command
  runs between steps); ``restore()`` and ``fork()`` start a container from that image.
  The whole container file system is part of the state (installed packages, ``/tmp``,
  ``$HOME``). Images form chains (a snapshot of a restored container is a child of the
  snapshot it came from); a chain is flattened (export + import: one layer) before it
  reaches Docker's layer limit (~125). Snapshot images are reference-counted: held by
  their snapshot handles, by containers started from them and by their child images,
  and removed when the count drops to zero.
* ``git`` (kind ``container+git``): trees of ``/testbed`` and its ``.git``, plus the
  permission bits git does not keep, in a private object store inside the container
  (``/var/lib/branchgym``). Fast (one ``exec``), but only ``/testbed`` is restored.
  Restoring into another container commits the source container first.
* ``overlay`` (kind ``container+overlay``): ``/testbed`` is the overlay backend's layer
  stack, mounted on the host and propagated into the container; snapshot and restore are
  host-side mounts (no Docker call), the rest of the container is read-only
  (:mod:`~branchgym.envs.swebench.docker_overlay`).

The container, its snapshots and the sandbox over it are in
:mod:`~branchgym.envs.swebench.docker_sandbox`; this module picks images and modes and
makes the sandboxes.

No CRIU: process state is not snapshotted. Nothing outlives a command: each runs under
``timeout``, and when it ends everything it started is killed (``kill -9 -1`` as the
sandbox user; as root, every process but init, the container's ``sleep`` and the
wrapper itself), so the container's only long-running process is ``sleep`` and every
snapshot sees a quiesced state.

Least privilege: no network (``network_mode=none``), every capability dropped except
CHOWN, DAC_OVERRIDE and FOWNER (which only root, i.e. branchgym's own snapshot and
digest commands, can use: Docker gives a non-root user no effective capabilities),
``no-new-privileges``, and the agent's commands run as uid 1000 in branchgym-built images
(``user=`` changes it; SWE-bench's and other given images run as root by default, since
they own ``/testbed`` and their conda environment as root). Limits
(:class:`~branchgym.envs.swebench.limits.Limits`): memory and swap, pids, ``RLIMIT_CPU``
and ``RLIMIT_FSIZE`` per container; the writable layer's size with ``--storage-opt
size=`` where the storage driver supports it (overlay2 on xfs with project quotas,
btrfs, zfs); elsewhere only the per-file limit holds. The root file system stays
writable: a snapshot is a commit of the container's writable layer.

Images (``image=``): by default (``auto``) SWE-bench's own per-instance image when one is
on the daemon (the task row's ``image``, else the names the ``swebench`` package gives it:
``swebench/sweb.eval.x86_64.<id, __ as _1776_>:latest`` as published, then
``sweb.eval.x86_64.<id>:latest`` as its build functions tag it locally; nothing is
pulled), else the base image (``branchgym/swebench-base:bookworm-<hash>``, built offline
by ``scripts/swebench_docker_image.sh``: Debian minbase with python3, pytest, pip, tkinter,
git), the repository's environment image over it (its ``pip install -e .``, once per
repository and version: :mod:`~branchgym.envs.swebench.docker_env`) and the task's
checkout at ``/testbed``, built once and kept. ``swebench`` requires SWE-bench's
image, ``branchgym`` always builds from the checkout, anything else is an image name or
an ``{instance_id}`` template. A SWE-bench image already holds the repository: no clone is
needed. Its commands run as its user (root) in its own environment: the image's ``ENV``
with the conda ``testbed`` environment activated as the harness's eval script does
(``source /opt/miniconda3/bin/activate; conda activate testbed``), read once per image;
and the submission is diffed against the image's ``HEAD`` (:attr:`DockerSandbox.base_ref`:
the task's base commit plus the image's own setup commit).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import shlex
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from branchgym.envs.swebench.docker_env import env_image, testbed_archive
from branchgym.envs.swebench.docker_overlay import (
    DockerOverlaySandbox,
    DockerOverlaySnapshot,
    OverlayLayers,
)
from branchgym.envs.swebench.docker_sandbox import (
    AGENT_HOME,
    HOST,
    IMAGE_INFO,
    OWNER_LABEL,
    SANDBOX_UID,
    SNAPSHOT_LABEL,
    Container,
    DockerGitSnapshot,
    DockerSandbox,
    DockerSnapshot,
    ImageInfo,
    ImageRefs,
    docker_sdk,
    owner_labels,
)
from branchgym.envs.swebench.limits import Limits
from branchgym.envs.swebench.sandbox import WORKDIR, SandboxSnapshot, default_env
from branchgym.envs.swebench.tasks import SWEBenchTask
from branchgym.error import DependencyMissingError, SandboxError, SandboxUnavailableError

__all__ = [
    "DockerBackend",
    "BASE_IMAGE",
    "BASE_PACKAGES_HASH",
    "docker_client",
    "owned_resources",
    "owner_dead",
    "prune_stale",
    "swebench_image_names",
    "wait_idle",
    "IMAGE_MODES",
    "SWEBENCH_NAMESPACE",
    "CONDA_ACTIVATE",
]

#: The first 8 hex digits of the sha256 of ``PACKAGES`` in scripts/swebench_docker_image.sh,
#: which tags the image it builds ``bookworm-<them>``: an image built from another package
#: list has another name, and is not taken for this one (a test checks the two agree).
BASE_PACKAGES_HASH = "805d44eb"
#: The base image ``scripts/swebench_docker_image.sh`` builds (``$BRANCHGYM_DOCKER_IMAGE``).
BASE_IMAGE = os.environ.get(
    "BRANCHGYM_DOCKER_IMAGE", f"branchgym/swebench-base:bookworm-{BASE_PACKAGES_HASH}"
)
#: ``image=`` words: SWE-bench's image if present else built here / SWE-bench's only /
#: built here only (anything else is an image name or ``{instance_id}`` template).
IMAGE_MODES = ("auto", "swebench", "branchgym")
#: The Docker Hub namespace SWE-bench publishes its images under.
SWEBENCH_NAMESPACE = "swebench"
#: What SWE-bench's eval scripts source before ``conda activate testbed``.
CONDA_ACTIVATE = "/opt/miniconda3/bin/activate"


_CLIENT: Any = None


def docker_client() -> Any:
    """A shared client of the local daemon (``DOCKER_HOST`` respected)."""
    global _CLIENT
    if _CLIENT is None:
        docker = docker_sdk()
        try:
            client = docker.from_env(timeout=3600)
            client.ping()
        except Exception as exc:
            raise SandboxUnavailableError(
                f"no Docker daemon answers ({type(exc).__name__}: {exc}). Start one (as root: "
                "`dockerd &`; `make test` does it), or use backend='local'."
            ) from exc
        _CLIENT = client
    return _CLIENT


def swebench_image_names(
    task: SWEBenchTask, namespace: str | None = SWEBENCH_NAMESPACE
) -> list[str]:
    """SWE-bench's image names for ``task``, in the order the backend looks them up.

    The task row's ``image`` (SWE-bench 5 rows name their image), then the name the
    ``swebench`` package's ``ImageSpec`` gives the instance under ``namespace`` (as
    published: ``swebench/sweb.eval.x86_64.django_1776_django-11099:latest``), then
    without a namespace (as its build functions tag a local build:
    ``sweb.eval.x86_64.django__django-11099:latest``).

    Raises:
        DependencyMissingError: the ``swebench`` package is not installed.
    """
    try:
        from swebench.image_builder.image_spec import ImageSpec
    except ImportError as exc:
        raise DependencyMissingError.for_extra(
            "SWE-bench's image names", "swebench", "swebench"
        ) from exc
    names = []
    if isinstance(task.extra.get("image"), str) and task.extra["image"]:
        names.append(task.extra["image"])
    for ns in dict.fromkeys([namespace, None]):
        # The package's own naming rule (arch tag, lower case, "__" -> "_1776_" when
        # namespaced); the Dockerfile is not needed for the name.
        spec = ImageSpec(instance_id=task.instance_id, dockerfile="(name only)", namespace=ns)
        if spec.name not in names:
            names.append(spec.name)
    return names


def owned_resources(client: Any | None = None, *, pid: int | None = None) -> dict[str, list[str]]:
    """Containers and snapshot images that branchgym processes (or one pid) own now."""
    client = client or docker_client()
    flt = [OWNER_LABEL]
    if pid is not None:
        flt.append(f"branchgym.pid={pid}")
    # The list endpoints alone (no inspect per item): background removals may be running.
    containers = client.api.containers(all=True, filters={"label": flt})
    images = client.api.images(filters={"label": [SNAPSHOT_LABEL, *flt[1:]]})
    return {"containers": [c["Id"] for c in containers], "images": [i["Id"] for i in images]}


def owner_dead(labels: Mapping[str, str]) -> bool:
    """Whether the branchgym process these owner labels name, on this host, has exited."""
    pid = labels.get("branchgym.pid", "")
    if labels.get("branchgym.host") != HOST or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def prune_stale(client: Any | None = None) -> int:
    """Remove containers and snapshot images left by dead branchgym processes on this host."""
    client = client or docker_client()
    removed = 0

    # Listed without an inspect per item, and a removal that finds nothing is fine: this
    # process's own background removals may be deleting containers at the same moment.
    gone = docker_sdk().errors.NotFound
    for c in client.api.containers(all=True, filters={"label": OWNER_LABEL}):
        if owner_dead(c.get("Labels") or {}):
            try:
                client.api.remove_container(c["Id"], force=True)
                removed += 1
            except gone:
                pass
    images = client.api.images(filters={"label": SNAPSHOT_LABEL})
    for img in sorted(images, key=lambda i: i.get("Created", 0), reverse=True):
        if owner_dead(img.get("Labels") or {}):
            try:
                client.api.remove_image(img["Id"], force=True)
                removed += 1
            except Exception:  # gone already, or a child still exists (a later pass)
                pass
    return removed


# ----------------------------------------------------------------------- backend


def _tag_part(s: str) -> str:
    return re.sub(r"[^a-z0-9_.-]+", "-", s.lower()).strip("-.")[:80] or "task"


class DockerBackend:
    """Makes Docker sandboxes.

    Args:
        snapshot_mode: ``commit`` (images), ``git`` (trees inside the container) or
            ``overlay`` (``/testbed`` as a host-side layer stack:
            :mod:`~branchgym.envs.swebench.docker_overlay`).
        image: ``auto`` (default; None is the same): SWE-bench's image of the task when
            the daemon has it (see :func:`swebench_image_names`), else the base image
            plus the task's checkout; ``swebench``: SWE-bench's image only;
            ``branchgym``: always the base image plus the checkout; anything else: an
            image name or a template with ``{instance_id}`` or ``{image}`` (the published
            name, e.g. ``mirror:5000/{image}``). Nothing is pulled.
        max_layers: Flatten a snapshot image once it has this many layers.
        limits: Resource limits (per container; see the module docstring).
        user: ``uid:gid`` the agent's commands run as; default ``1000:1000`` in
            branchgym-built images (which give it /testbed and /home/agent), ``0:0``
            (SWE-bench's container user) in SWE-bench's and other given images.
    """

    def __init__(
        self,
        *,
        snapshot_mode: str = "commit",
        image: str | None = None,
        max_layers: int = 100,
        limits: Limits | Mapping[str, Any] | None = None,
        user: str | None = None,
    ) -> None:
        """Connect to the daemon and clean up after dead processes."""
        if snapshot_mode not in ("commit", "git", "overlay"):
            raise SandboxError(
                f"snapshot_mode must be 'commit', 'git' or 'overlay', not {snapshot_mode!r}"
            )
        self.snapshot_mode = snapshot_mode
        self.image = image or "auto"
        self.max_layers = max_layers
        self.limits = Limits.of(limits)  # type: ignore[arg-type]
        if user is not None and not re.fullmatch(r"\d+(:\d+)?", str(user)):
            raise SandboxError(f"user must be 'uid' or 'uid:gid' (numbers), not {user!r}")
        #: The agent's user in branchgym-built images, and in SWE-bench's / given ones.
        self.user = str(user or f"{SANDBOX_UID}:{SANDBOX_UID}")
        self.image_user = str(user or "0:0")
        self.client = docker_client()
        self.images = _images_for(self.client)
        #: image id -> how its containers run commands (snapshot images inherit it);
        #: shared by the backends of one daemon, as snapshots restore across env instances.
        self._info = IMAGE_INFO.setdefault(id(self.client), {})
        self.pool = _pool()
        #: The overlay mode's host side (layer store, image bases); None in other modes.
        #: Made here, so a process that cannot mount overlayfs is refused at once.
        self.overlay: Any = None
        if snapshot_mode == "overlay":
            self.overlay = OverlayLayers(self)
        prune_stale(self.client)

    @property
    def kind(self) -> str:
        """Snapshot kind of the sandboxes it makes."""
        return {"git": "container+git", "overlay": "container+overlay"}.get(
            self.snapshot_mode, "container"
        )

    def default_env(self) -> dict[str, str]:
        """The environment a new shell starts with."""
        return default_env(home="/root" if self.user.split(":")[0] == "0" else AGENT_HOME)

    def run_options(self) -> dict[str, Any]:
        """``containers.run`` keywords: least privilege and the resource limits."""
        docker = docker_sdk()
        lim = self.limits
        opts: dict[str, Any] = {
            # PID 1 is Docker's init: it reaps what the per-command kill leaves as zombies
            # (a zombie still counts against the pids limit).
            "init": True,
            "cap_drop": ["ALL"],
            "cap_add": ["CHOWN", "DAC_OVERRIDE", "FOWNER"],
            "security_opt": ["no-new-privileges"],
        }
        if lim.memory is not None:
            opts["mem_limit"] = lim.memory
            opts["memswap_limit"] = lim.memory
        if lim.pids is not None:
            opts["pids_limit"] = lim.pids
        ulimits = []
        if lim.cpu is not None:
            ulimits.append(docker.types.Ulimit(name="cpu", soft=lim.cpu, hard=lim.cpu))
        if lim.disk is not None:
            ulimits.append(docker.types.Ulimit(name="fsize", soft=lim.disk, hard=lim.disk))
            if self.disk_quota_supported():
                opts["storage_opt"] = {"size": str(lim.disk)}
        if ulimits:
            opts["ulimits"] = ulimits
        return opts

    def disk_quota_supported(self) -> bool:
        """Does the storage driver take ``--storage-opt size=`` (probed once per daemon)?"""
        key = id(self.client)
        if key not in _QUOTA:
            try:
                c = self.client.containers.create(
                    BASE_IMAGE,
                    ["true"],
                    storage_opt={"size": "1G"},
                    labels=owner_labels(),
                )
            except Exception:  # APIError: the driver has no quota; ImageNotFound: unknown
                _QUOTA[key] = False
            else:
                c.remove(force=True)
                _QUOTA[key] = True
        return _QUOTA[key]

    def enforced_limits(self) -> dict[str, str]:
        """Each limit in force and what enforces it."""
        lim = self.limits
        out = {}
        if lim.memory is not None:
            out["memory"] = "container memory cgroup (memory + swap)"
        if lim.pids is not None:
            out["pids"] = "container pids cgroup"
        if lim.cpu is not None:
            out["cpu"] = "RLIMIT_CPU"
        if lim.disk is not None:
            out["disk"] = (
                "storage-opt size"
                if self.disk_quota_supported()
                else "RLIMIT_FSIZE (per file only)"
            )
        return out

    def cgroup_counts(self, container_id: str) -> dict[str, int]:
        """OOM kills and pids-limit hits of a container so far (0 where unreadable)."""
        out = {"oom_kill": 0, "pids_max": 0}
        for ctl, name, key, field in (
            ("memory", "memory.oom_control", "oom_kill", "oom_kill"),
            ("memory", "memory.events", "oom_kill", "oom_kill"),
            ("pids", "pids.events", "pids_max", "max"),
        ):
            for base in (f"/sys/fs/cgroup/{ctl}/docker", "/sys/fs/cgroup/docker",
                         "/sys/fs/cgroup/system.slice"):  # fmt: skip
                leaf = (
                    container_id if "system.slice" not in base else f"docker-{container_id}.scope"
                )
                try:
                    text = Path(base, leaf, name).read_text()
                except OSError:
                    continue
                for line in text.splitlines():
                    k, _, v = line.partition(" ")
                    if k == field and v.strip().isdigit():
                        out[key] = max(out[key], int(v))
                break
        return out

    def later(self, fn: Any) -> None:
        """Run ``fn`` in the background (container removal is ~0.1-0.3 s)."""
        _FUTURES.append(self.pool.submit(fn))

    def wait_idle(self) -> None:
        """Wait for background removals."""
        wait_idle()

    # -- images -------------------------------------------------------------------
    def image_info(self, image_id: str) -> ImageInfo:
        """How commands run in containers of ``image_id``."""
        return self._info.get(image_id) or ImageInfo(user=self.user)

    def given_image(self, task: SWEBenchTask) -> tuple[str, str] | None:
        """(image id, name) of the image ``task`` runs in when it is not built here.

        None when the task's checkout is built into the base image instead (``branchgym``,
        or ``auto`` without SWE-bench's image on the daemon).

        Raises:
            SandboxUnavailableError: ``swebench`` or a named image, and the daemon does
                not have it (the message says how to load it).
        """
        docker = docker_sdk()
        if self.image == "branchgym":
            return None
        if self.image in ("auto", "swebench"):
            try:
                names = swebench_image_names(task)
            except DependencyMissingError:
                if self.image == "swebench":
                    raise
                return None
        else:
            fields = {"instance_id": task.instance_id}
            if "{image}" in self.image:  # e.g. a registry mirror: "mirror:5000/{image}"
                published = swebench_image_names(dataclasses.replace(task, extra={}))[0]
                fields["image"] = published
            names = [self.image.format(**fields)]
        for name in names:
            try:
                return self.client.images.get(name).id, name
            except docker.errors.ImageNotFound:
                continue
        if self.image == "auto":
            return None
        raise SandboxUnavailableError(
            f"no image for {task.instance_id} on this Docker daemon (looked for "
            f"{', '.join(map(repr, names))}); branchgym never pulls images: `docker load` "
            "a saved image, pull it from your registry mirror and `docker tag` it to one of "
            "these names, or build it with the swebench package (docs/swebench.md, Docker)."
        )

    def needs_checkout(self, task: SWEBenchTask) -> bool:
        """Does ``task`` need a local clone (False when its image holds the repository)?"""
        return self.given_image(task) is None

    def task_image(self, task: SWEBenchTask, checkout: Path | None) -> str:
        """The image of ``task``: SWE-bench's / the given one, or its checkout built in."""
        docker = docker_sdk()
        given = self.given_image(task)
        if given is not None:
            image_id, name = given
            if image_id not in self._info:
                self._info[image_id] = ImageInfo(user=self.image_user, name=name)
            return image_id
        if checkout is None:
            raise SandboxUnavailableError(
                f"{task.instance_id} has no SWE-bench image on this daemon and no checkout "
                "was given: load its image (docs/swebench.md, Docker) or pass repos_dir."
            )
        try:
            base = self.client.images.get(BASE_IMAGE)
        except docker.errors.ImageNotFound as exc:
            raise SandboxUnavailableError(
                f"the base image {BASE_IMAGE!r} is missing: build it offline with "
                "scripts/swebench_docker_image.sh (make test does), or pass docker_image=."
            ) from exc
        # Over the repository's environment image (docker_env: built once per repository
        # and version) where the checkout is installable, else over the base image.
        parent = env_image(self.client, base, task, checkout, BASE_IMAGE) or base.id
        # "-u1000": /testbed and /home/agent belong to the sandbox user (older task images
        # of the same checkout, owned by root, are not reused).
        tag = (
            f"{_tag_part(task.instance_id)}-{task.base_commit[:12]}-"
            f"{parent.split(':')[-1][:12]}-u{SANDBOX_UID}"
        )
        name = f"branchgym/swebench-task:{tag}"
        with _BUILD_LOCK:
            try:
                return self.client.images.get(name).id
            except docker.errors.ImageNotFound:
                pass
            c = self.client.containers.create(parent, ["true"], labels=owner_labels())
            try:
                c.put_archive("/", testbed_archive(checkout, SANDBOX_UID, folders=(AGENT_HOME,)))
                c.commit(
                    repository="branchgym/swebench-task",
                    tag=tag,
                    changes=[f"WORKDIR {WORKDIR}"],
                    conf={"Labels": {"branchgym.task": task.instance_id}},
                )
            finally:
                c.remove(force=True)
            return self.client.images.get(name).id

    def commit(self, box: Container) -> str:
        """Commit a container into a snapshot image (flattened near the layer limit)."""
        img = box.c.commit(pause=False, conf={"Labels": owner_labels(**{SNAPSHOT_LABEL: "1"})})
        self.images.adopt(img.id, box.image_id)
        if box.info.name:  # a SWE-bench image's snapshots run commands as it does
            self._info[img.id] = box.info
        layers = len(img.attrs.get("RootFS", {}).get("Layers", []))
        if layers < self.max_layers:
            return img.id
        flat = self._flatten(box, img)
        return flat

    def _flatten(self, box: Container, img: Any) -> str:
        """One-layer copy of ``img`` (export of its container + import)."""
        cfg = img.attrs.get("Config", {})
        changes = [f"WORKDIR {cfg.get('WorkingDir') or WORKDIR}"]
        changes += [f"ENV {e}" for e in cfg.get("Env") or []]
        changes += [f"LABEL {SNAPSHOT_LABEL}=1", f"LABEL {OWNER_LABEL}=1"]
        changes += [f"LABEL branchgym.pid={os.getpid()}", f"LABEL branchgym.host={HOST}"]
        tmp = Container(self, img.id)
        try:
            with tempfile.NamedTemporaryFile(suffix=".tar") as f:
                for chunk in tmp.c.export():
                    f.write(chunk)
                f.flush()
                out = self.client.api.import_image(src=f.name, changes=changes)
        finally:
            tmp.drop()
        line = [json.loads(x) for x in out.strip().splitlines() if x.strip()][-1]
        flat_id = line.get("status", "")
        if not flat_id.startswith("sha256:"):
            raise SandboxError(f"flattening a snapshot image failed: {out[-300:]}")
        self.images.adopt(flat_id, None)
        if img.id in self._info:
            self._info[flat_id] = self._info[img.id]
        self.images.hold(img.id)
        self.later(lambda: self.images.drop(img.id))  # the unflattened image goes
        return flat_id

    # -- sandboxes ----------------------------------------------------------------
    def create(self, task: SWEBenchTask, checkout: Path | None) -> DockerSandbox:
        """A container at the task's base commit (``checkout``: None for a given image)."""
        sb: DockerSandbox
        if self.snapshot_mode == "overlay":
            sb = DockerOverlaySandbox(self, self.task_image(task, checkout))
        else:
            sb = DockerSandbox(self, self.task_image(task, checkout))
        info = sb.box.info
        if info.name and info.env is None:
            try:
                info = self._probe(sb, info)
            except BaseException:
                sb.close()
                raise
            self._info[sb.box.image_id] = sb.box.info = info
        return sb

    def _probe(self, sb: DockerSandbox, info: ImageInfo) -> ImageInfo:
        """Read a given image's environment (``testbed`` activated) and ``/testbed``'s HEAD."""
        try:  # the package's name for it, where installed
            from swebench.image_builder.constants import CONTAINER_ENV_NAME as env_name
        except ImportError:
            env_name = "testbed"
        act = shlex.quote(CONDA_ACTIVATE)
        script = (
            f"if [ -f {act} ]; then {{ source {act} && conda activate {env_name}; }} "
            ">/dev/null 2>&1 || { echo 'conda activate failed' >&2; exit 3; }; fi; "
            f"git -c safe.directory='*' -C {WORKDIR} rev-parse HEAD 2>/dev/null || echo; env -0"
        )
        res = sb._exec(["bash", "-c", script], 120.0, user=info.user)
        if res.exit_code != 0:
            raise SandboxError(
                f"image {info.name!r}: `source {CONDA_ACTIVATE}; conda activate "
                f"{env_name}` failed (SWE-bench's eval scripts need it): {res.text[-500:]}"
            )
        head, _, blob = res.output.partition(b"\n")
        env = {}
        for item in blob.split(b"\x00"):
            k, sep, v = item.decode("utf-8", "surrogateescape").partition("=")
            if sep and k not in ("PWD", "OLDPWD", "SHLVL", "_"):
                env[k] = v
        # branchgym's non-interactive defaults (pager off, no bytecode, a git identity)
        # where the image sets nothing; the image's own values (PATH, HOME...) win.
        merged = {k: v for k, v in default_env(home="/root").items() if k != "PATH"}
        merged.update(env)
        return dataclasses.replace(info, env=merged, head=head.decode().strip() or None)

    def from_snapshot(self, snap: SandboxSnapshot) -> DockerSandbox:
        """A new container in ``snap``'s state."""
        snap.check()
        if self.snapshot_mode == "overlay":
            if isinstance(snap, DockerOverlaySnapshot):
                return DockerOverlaySandbox(self, snap.image_id, snap.layers.stack)
            raise SandboxError(f"the docker-overlay backend cannot restore a {snap.kind} snapshot")
        if isinstance(snap, DockerSnapshot):
            return DockerSandbox(self, snap.image_id)
        if isinstance(snap, DockerGitSnapshot):
            sb = DockerSandbox(self, self.commit(snap.container))
            sb._git_restore(snap.manifest_id)
            return sb
        raise SandboxError(f"the docker backend cannot restore a {snap.kind} snapshot")


_BUILD_LOCK = threading.Lock()
_QUOTA: dict[int, bool] = {}
_IMAGES: dict[int, ImageRefs] = {}
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_FUTURES: list[concurrent.futures.Future] = []


def _images_for(client: Any) -> ImageRefs:
    return _IMAGES.setdefault(id(client), ImageRefs(client))


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="branchgym-docker")
    return _POOL


def wait_idle() -> None:
    """Wait until background container and image removals are done."""
    while _FUTURES:
        fut = _FUTURES.pop(0)
        fut.result()
