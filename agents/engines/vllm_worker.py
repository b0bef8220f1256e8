"""vLLM in its own process while training goes on in this one, with weight sync after updates.

vLLM pins its own torch stack, so on this project's machines it lives in its own virtual
environment (``.venv-vllm``) and the trainer cannot import it. :class:`VLLMWorker` starts
a worker process with that venv's Python::

    .venv-vllm/bin/python -m branchgym.agents.engines.vllm_worker serve MODEL_DIR SOCKET

and talks to it over a Unix socket (local only; the connection is authenticated with a
random key handed over in the environment, never on the command line). Messages carry
plain Python lists, so the two venvs need not share numpy or torch builds.

The worker runs :class:`~branchgym.agents.engines.vllm.VLLMEngine`: automatic prefix
caching on, and each request carries ``n`` samples, so the siblings of a branch point
are one vLLM request (one prefill of their shared context). :class:`VLLMWorker` has the
engine interface :class:`~branchgym.agents.policies.policy.LLMPolicy` and
:class:`~branchgym.agents.policies.scoring.ScoringPolicy` use (``generate``, ``score``,
``encode``, ``decode``, ``stop_token_ids``, ``max_positions``), with the tokenizer kept
in this process.

Weight sync: after an optimizer step the trainer calls :meth:`VLLMWorker.clear_cache`
(as it does for the in-process engine); the next ``generate`` or ``score`` first writes
the model's state dict as one safetensors file to a shared-memory folder
(``/dev/shm`` where it exists) and the worker loads it in place through vLLM's
``reload_weights`` (the model runner's ``load_weights``: stacked QKV and gate/up
projections are re-packed by vLLM), then drops its prefix cache, whose KV blocks were
computed with the old weights. No restart; the sync of the CI model takes well under a
second. docs/engine.md ("Training with vLLM") has the figures.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.error import DependencyMissingError, EngineError

__all__ = [
    "VLLMWorker",
    "find_vllm_python",
    "is_weights_file",
    "serve",
    "state_dict_for_vllm",
]

_KEY_ENV = "BRANCHGYM_VLLM_AUTHKEY"


def find_vllm_python(python: str | None = None) -> str:
    """The Python that runs the worker.

    ``python``, else ``$BRANCHGYM_VLLM_PYTHON``, else this one if it imports vLLM, else the
    project's ``.venv-vllm/bin/python`` (``make vllm-venv``).
    """
    given = python or os.environ.get("BRANCHGYM_VLLM_PYTHON")
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise DependencyMissingError(
                f"vllm_python {given!r} is not an executable file; give the python of a "
                "virtual environment that has vLLM (e.g. .venv-vllm/bin/python)."
            )
        return given
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    here = Path(__file__).resolve()
    for root in (Path.cwd(), *here.parents):
        cand = root / ".venv-vllm" / "bin" / "python"
        if cand.is_file():
            return str(cand)
    raise DependencyMissingError(
        "engine='vllm' needs vLLM: install it in this environment (pip install vllm, on a GPU "
        "machine), or make the project's .venv-vllm (make vllm-venv), or pass vllm_python="
        "<python of a venv with vLLM>."
    )


def is_weights_file(path: Path) -> bool:
    """A model weights file of a ``save_pretrained`` folder (``model*.safetensors``)."""
    return path.name.startswith("model") and path.name.endswith(".safetensors")


def state_dict_for_vllm(model: Any) -> dict[str, Any]:
    """The model's weights under Hugging Face names, each tensor once, contiguous, on CPU.

    Tied weights (the tiny model's ``lm_head`` is its embedding) are written once, under
    the first name (vLLM skips ``lm_head`` of a tied model). A ``peft`` model's LoRA
    adapters are merged into the base weights for the copy (and unmerged again here).
    """
    merged = hasattr(model, "merge_adapter") and hasattr(model, "get_base_model")
    if merged:
        model.merge_adapter()
    try:
        base = model.get_base_model() if merged else model
        out: dict[str, Any] = {}
        seen: set[int] = set()
        for name, t in base.state_dict().items():
            if "lora_" in name:
                continue
            key = t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)
            if key in seen:
                continue
            seen.add(key)
            out[name.replace(".base_layer.", ".")] = t.detach().to("cpu").contiguous().clone()
        return out
    finally:
        if merged:
            model.unmerge_adapter()


class VLLMWorker:
    """A vLLM worker process behind the engine interface, with weight sync.

    Args:
        model: A model folder (``save_pretrained`` output) the worker starts from.
        tokenizer: The model's tokenizer (default: loaded from ``model``).
        trainer_model: A function returning the trainer's current model; after
            :meth:`clear_cache` its weights are copied to the worker before the next
            generation (None: never synced automatically).
        python: The worker's Python (see :func:`find_vllm_python`).
        max_new_tokens: Default cap on sampled tokens.
        llm_kwargs: Keyword arguments of ``vllm.LLM`` (``max_model_len``,
            ``gpu_memory_utilization``, ``dtype``...). Unless given, the worker uses
            ``gpu_memory_utilization=0.3`` and ``dtype="bfloat16"`` on CUDA (the trainer
            shares the GPU) and ``enforce_eager=True`` without CUDA (no torch.compile
            warm-up); float32 otherwise.
        startup_timeout: Seconds the worker may take to start.
        log_path: Where the worker's output goes (default: in its temporary folder).
        remove_model: Delete the ``model`` folder on :meth:`close` (a copy made for the
            worker, e.g. by :func:`~branchgym.agents.training.vllm_training.start_worker`).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        tokenizer: Any = None,
        trainer_model: Callable[[], Any] | None = None,
        python: str | None = None,
        max_new_tokens: int = 48,
        llm_kwargs: dict[str, Any] | None = None,
        startup_timeout: float = 900.0,
        log_path: str | os.PathLike[str] | None = None,
        remove_model: bool = False,
    ) -> None:
        """Start the worker and wait until its engine is up."""
        model = str(model)
        self._remove = [Path(model)] if remove_model else []
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise EngineError(f"{model} is not a model folder (no config.json)")
        others = [f.name for f in Path(model).glob("*.safetensors") if not is_weights_file(f)]
        if others:
            raise EngineError(
                f"{model} holds other safetensors files than the model's ({', '.join(others)}); "
                "vLLM would load them as weights. Give a folder with only the model (a "
                "checkpoint's optimizer state: use worker_model_folder(model, tokenizer))."
            )
        py = find_vllm_python(python)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.stop_token_ids = [] if eos is None else [int(eos)]
        self.max_new_tokens = int(max_new_tokens)
        cfg = json.loads(Path(model, "config.json").read_text())
        kwargs = dict(llm_kwargs or {})
        self.max_positions = int(
            kwargs.get("max_model_len", min(2048, int(cfg.get("max_position_embeddings", 2048))))
        )
        self.trainer_model = trainer_model
        self._stale = False
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.workdir = Path(tempfile.mkdtemp(prefix="branchgym-vllm-", dir=shm))
        self.weights_dir = self.workdir / "weights"
        self.weights_dir.mkdir()
        self.socket = str(self.workdir / "worker.sock")
        self.log_path = Path(log_path) if log_path else self.workdir / "worker.log"
        #: what the worker did (requests, samples, weight syncs) and what syncs cost here.
        self.stats: dict[str, float] = {"syncs": 0, "sync_s": 0.0, "sync_bytes": 0}
        env = dict(os.environ)
        env[_KEY_ENV] = (key := os.urandom(32)).hex()
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker is the process
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU-only host
        cmd = [py, "-m", "branchgym.agents.engines.vllm_worker", "serve", model, self.socket]
        cmd += ["--max-new-tokens", str(self.max_new_tokens), "--llm-kwargs", json.dumps(kwargs)]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - open for the worker's life
        self._conn: Any = None
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
        )
        try:
            self._conn = self._connect(key, startup_timeout)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- process
    def _log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def _connect(self, key: bytes, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise EngineError(
                    f"the vLLM worker exited with code {self.proc.returncode} while starting; "
                    f"its log ({self.log_path}) ends with:\n{self._log_tail()}"
                )
            if os.path.exists(self.socket):
                try:
                    return Client(self.socket, family="AF_UNIX", authkey=key)
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
            if time.monotonic() > deadline:
                raise EngineError(
                    f"the vLLM worker did not start within {timeout:.0f} s; raise "
                    f"startup_timeout or read its log {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.2)

    def _call(self, op: str, **kwargs: Any) -> Any:
        if self._conn is None:
            raise EngineError("the vLLM worker is closed; start a new VLLMWorker.")
        try:
            self._conn.send((op, kwargs))
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EngineError(
                f"lost the vLLM worker ({type(exc).__name__}); its log ({self.log_path}) ends "
                f"with:\n{self._log_tail()}"
            ) from exc
        if status != "ok":
            raise EngineError(f"the vLLM worker failed on {op!r}: {value}")
        return value

    def close(self) -> None:
        """Stop the worker and remove its shared-memory folder."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.send(("close", {}))
                self._conn.recv()
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
        for stop in (None, self.proc.terminate, self.proc.kill):  # ask, then insist
            if self.proc.poll() is not None:
                break
            if stop is not None:
                stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        self._log.close()
        for folder in [self.workdir, *self._remove]:
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> VLLMWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # a run that raised before close(): no orphan worker
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(Exception):
                self.close()

    # ---------------------------------------------------------------- weights
    def clear_cache(self) -> None:
        """The trainer's weights changed: sync them before the next generation."""
        self._stale = True

    def sync_weights(self, model: Any = None) -> float:
        """Copy ``model``'s weights (default: the trainer's) into the worker; seconds taken."""
        from safetensors.torch import save_file

        if model is None and self.trainer_model is not None:
            model = self.trainer_model()
        if model is None:
            raise EngineError("sync_weights needs the model (or VLLMWorker(trainer_model=...)).")
        t0 = time.perf_counter()
        tensors = state_dict_for_vllm(model)
        tmp = self.weights_dir / "model.safetensors.partial"
        save_file(tensors, str(tmp))
        os.replace(tmp, self.weights_dir / "model.safetensors")
        self._call("load_weights", path=str(self.weights_dir))
        secs = time.perf_counter() - t0
        self.stats["syncs"] += 1
        self.stats["sync_s"] += secs
        self.stats["sync_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        self._stale = False
        return secs

    def _fresh(self) -> None:
        if self._stale and self.trainer_model is not None:
            self.sync_weights()

    def worker_stats(self) -> dict[str, float]:
        """The worker's counters: ``requests``, ``samples``, ``calls``, ``weight_loads``."""
        return dict(self._call("stats"))

    # ---------------------------------------------------------------- engine interface
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int | Sequence[int] = 1,
        *,
        prefixes: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int | None = None,
        seed: int | None = None,
    ) -> list[list[Any]]:
        """Sample ``n[i]`` completions of each prompt in the worker (one request each)."""
        from branchgym.agents.engines.vllm import Generation

        self._fresh()
        counts = [int(n)] * len(prompts) if isinstance(n, int) else [int(k) for k in n]
        out = self._call(
            "generate",
            prompts=[[int(t) for t in p] for p in prompts],
            n=counts,
            prefixes=[[int(t) for t in f] for f in prefixes] if prefixes else None,
            max_new_tokens=max_new_tokens,
            seed=None if seed is None else int(seed),
        )
        return [
            [
                Generation(
                    token_ids=np.asarray(g["token_ids"], dtype=np.int64),
                    logprobs=np.asarray(g["logprobs"], dtype=np.float32),
                    entropies=np.asarray(g["entropies"], dtype=np.float32),
                    entropies_top20=np.asarray(g["entropies_top20"], dtype=np.float32),
                    prefix_len=int(g["prefix_len"]),
                    finish_reason=str(g["finish_reason"]),
                )
                for g in gens
            ]
            for gens in out
        ]

    def score(
        self, prompt: Sequence[int], completions: Sequence[Sequence[int]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Log-prob and entropy of each completion token given ``prompt``, in the worker."""
        self._fresh()
        out = self._call(
            "score",
            prompt=[int(t) for t in prompt],
            completions=[[int(t) for t in c] for c in completions],
        )
        return [(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in out]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


# -------------------------------------------------------------------- the worker side
def serve(model: str, socket_path: str, max_new_tokens: int, llm_kwargs: dict[str, Any]) -> None:
    """Run a :class:`VLLMEngine` on ``model`` and answer one trainer on ``socket_path``."""
    import torch

    from branchgym.agents.engines.vllm import VLLMEngine

    key = bytes.fromhex(os.environ.pop(_KEY_ENV))
    kwargs = dict(llm_kwargs)
    if torch.cuda.is_available():
        # the trainer shares the GPU: vLLM takes a third of it (weights + KV cache), and
        # samples in bf16 like the trainer's autocast (vllm_options override both)
        kwargs.setdefault("gpu_memory_utilization", 0.3)
        kwargs.setdefault("dtype", "bfloat16")
    else:
        kwargs.setdefault("enforce_eager", True)  # no torch.compile warm-up on CPU
    t0 = time.perf_counter()
    eng = VLLMEngine(model, max_new_tokens=max_new_tokens, **kwargs)
    print(f"branchgym vLLM worker: engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    stats = {"calls": 0, "requests": 0, "samples": 0, "weight_loads": 0, "load_s": 0.0}

    def generate(prompts, n, prefixes, max_new_tokens, seed):  # noqa: ANN001, ANN202
        stats["requests"] += len(prompts)
        stats["samples"] += sum(n)
        gens = eng.generate(prompts, n, prefixes=prefixes, max_new_tokens=max_new_tokens, seed=seed)
        return [
            [
                {
                    "token_ids": g.token_ids.tolist(),
                    "logprobs": g.logprobs.tolist(),
                    "entropies": g.entropies.tolist(),
                    "entropies_top20": g.entropies_top20.tolist(),
                    "prefix_len": g.prefix_len,
                    "finish_reason": g.finish_reason,
                }
                for g in per
            ]
            for per in gens
        ]

    def score(prompt, completions):  # noqa: ANN001, ANN202
        return [(a.tolist(), b.tolist()) for a, b in eng.score(prompt, completions)]

    def load_weights(path):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        eng.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        eng.llm.collective_rpc(_repack_cpu_heads)
        eng.llm.reset_prefix_cache()  # its KV blocks hold the old weights' activations
        stats["weight_loads"] += 1
        stats["load_s"] += time.perf_counter() - t
        return stats["weight_loads"]

    ops = {
        "generate": generate,
        "score": score,
        "load_weights": load_weights,
        "stats": lambda: dict(stats),
    }
    with Listener(socket_path, family="AF_UNIX", authkey=key) as listener:
        conn = listener.accept()
        while True:
            try:
                op, kw = conn.recv()
            except EOFError:
                break
            if op == "close":
                conn.send(("ok", None))
                break
            stats["calls"] += 1
            try:
                conn.send(("ok", ops[op](**kw)))
            except Exception as exc:  # noqa: BLE001 - reported to the trainer, which raises
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        conn.close()


def _repack_cpu_heads(worker: Any) -> int:
    """Re-pack the CPU GEMM copy of embedding-type heads after an in-place reload.

    On CPU, vLLM packs each embedding-method layer's weight into a private GEMM copy
    (``cpu_linear``). A tied ``lm_head`` receives no weights of its own on reload (its
    weight is the embedding's, updated in place), so its packed copy would keep the old
    weights and the logits would come from them. Runs in the worker (collective_rpc).
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    n = 0
    for module in worker.model_runner.get_model().modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(module, VocabParallelEmbedding)
            and hasattr(module, "cpu_linear")
            and weight is not None
            and weight.numel()
        ):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


def _main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m branchgym.agents.engines.vllm_worker")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run a vLLM worker for a trainer (VLLMWorker starts it)")
    s.add_argument("model")
    s.add_argument("socket")
    s.add_argument("--max-new-tokens", type=int, default=48)
    s.add_argument("--llm-kwargs", default="{}", help="JSON keyword arguments of vllm.LLM")
    a = parser.parse_args(argv)
    if _KEY_ENV not in os.environ:
        parser.error(f"{_KEY_ENV} is not set: the worker is started by VLLMWorker")
    serve(a.model, a.socket, a.max_new_tokens, json.loads(a.llm_kwargs))
    return 0


if __name__ == "__main__":  # vLLM may start processes: keep this guard
    sys.exit(_main(sys.argv[1:]))
