"""An OpenAI-compatible chat-completions endpoint as a policy (``branchgym eval`` agents).

:class:`EndpointPolicy` implements :class:`~branchgym.rollout.policy.Policy` by asking a
server that speaks OpenAI's ``POST {base_url}/chat/completions`` (vLLM's ``vllm serve``,
llama.cpp's server, a hosted API): the env's prompt builder
(:func:`~branchgym.agents.policies.prompts.prompt_for`) turns the context into chat
messages, and the same builder parses the reply into the env action. A reply that does
not parse is sent to the env as it is, with ``parse_error`` set, so the env answers
with its own invalid-action feedback: a bad reply is the agent's failure, never a crash.

What the infrastructure gets wrong raises :class:`~branchgym.error.EndpointError`
(nothing listening, timeouts, HTTP errors after the bounded retries, a wrong model
name, a body that is not chat-completions JSON); a missing API key raises
:class:`~branchgym.error.EndpointAuthError` naming the environment variable. The key
itself is read from that variable, never passed on a command line or written to a file.

One HTTP request per sample (``n`` is never sent): servers differ on ``n`` (vLLM
refuses ``n > 1`` with greedy sampling, llama.cpp ignores it), and one request per
sample lets each sample carry its own ``seed``, drawn from the rollout's own random
stream (:func:`~branchgym.rollout.policy.sample_rng`), so a rerun asks the server for
the same samples whichever other rollouts share the batch. At most ``max_concurrent``
requests are in flight, however many threads call ``act``. The client is the standard
library's ``urllib``: one JSON POST per sample needs nothing more, and the policy raises
its own typed errors (an extra client would bring its own retry loop and exception tree
to translate, and a dependency the ``make test`` venv would have to install).

Token accounting: :attr:`EndpointPolicy.usage` holds the totals the server reported
(``prompt_tokens``, ``completion_tokens``, ...) and :attr:`EndpointPolicy.calls` one
record per request (tokens, latency, attempts, finish reason). Each sample is an
:class:`EndpointSample` carrying its own usage. Its ``token_ids``, ``logprobs`` and
``entropies`` stay empty: a chat endpoint gives neither token ids nor the exact
per-token entropies a rollout tree stores beside each token (``Node`` requires all
three per token), and nothing is made up. The server's per-token log-probs, when it
returns them, are kept as :attr:`EndpointSample.server_logprobs` (vLLM reports the
model's raw log-probs, before temperature and ``top_p``). An endpoint policy is for
evaluation: learners need ``pi_old`` per token, which only an in-process engine gives.
"""

from __future__ import annotations

import dataclasses
import http.client
import ipaddress
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from branchgym.agents.policies.prompts import prompt_for
from branchgym.error import EndpointAuthError, EndpointError, EngineError, OptionError
from branchgym.rollout.policy import ActionSample, ActRequest, sample_rng

__all__ = ["EndpointPolicy", "EndpointSample", "RETRY_STATUS"]

#: HTTP statuses worth another try: timeouts, rate limits, server errors.
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})

#: Longest wait between two tries (seconds), whatever the backoff or ``Retry-After`` says.
MAX_BACKOFF_S = 30.0

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_F32 = np.zeros(0, dtype=np.float32)


@dataclasses.dataclass
class EndpointSample(ActionSample):
    """An :class:`~branchgym.rollout.policy.ActionSample` with what the server reported.

    Attributes:
        prompt_tokens: Prompt tokens the server counted (``None`` if it sent no usage).
        completion_tokens: Tokens it generated for this sample (``None`` likewise).
        finish_reason: ``stop``, ``length``, ... as the server said.
        latency_s: Seconds from the first try to the answer, retries included.
        server_logprobs: The server's log-prob of each generated token, when it returned
            them (float32), else ``None``.
        seed: The seed sent with the request, else ``None``.
    """

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    latency_s: float = 0.0
    server_logprobs: np.ndarray | None = None
    seed: int | None = None


class _Retryable(Exception):
    """A failed try that may succeed on the next one (carries the final error)."""

    def __init__(self, error: EndpointError, retry_after: float | None = None):
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _server_message(body: bytes) -> str:
    """The error text of an HTTP error body (OpenAI's ``{"error": {"message": ...}}``)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(data, dict):
        err = data.get("error", data.get("detail"))
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        if isinstance(err, str):
            return err[:300]
    return text[:300]


def _count(usage: Any, key: str) -> int | None:
    value = usage.get(key) if isinstance(usage, dict) else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


class EndpointPolicy:
    """A policy that asks an OpenAI-compatible chat-completions endpoint for each action.

    Args:
        base_url: The API root, usually ending in ``/v1`` (``http://127.0.0.1:8000/v1``);
            requests go to ``{base_url}/chat/completions``.
        model: The model name the server serves (``vllm serve --served-model-name``).
        api_key_env: Name of the environment variable that holds the API key, sent as
            ``Authorization: Bearer``; ``None`` sends no key (local servers).
        temperature: Sampling temperature (0: greedy).
        top_p: Nucleus sampling mass; ``None`` leaves the server's default.
        max_tokens: Most tokens generated per reply.
        seed: Base of the per-request seeds: each sample's seed mixes it with a draw
            from the sample's own random stream. ``None`` sends no seed (for servers
            that reject the field).
        stop: Stop string(s), or ``None``.
        logprobs: Ask for the sampled tokens' log-probs. A server that refuses them
            (HTTP 400 naming ``logprobs``) is asked again without, once for the run.
        max_concurrent: Most HTTP requests in flight at once, over all threads that call
            :meth:`act` (each call sends its samples from a thread pool).
        timeout_s: Seconds to wait to connect and for each read of an answer.
        retries: Further tries after a connection error, a timeout or an HTTP status in
            :data:`RETRY_STATUS`; other 4xx answers and garbage bodies fail at once.
        backoff_s: Wait before the first retry, doubled for each next one (a
            ``Retry-After`` header wins), at most :data:`MAX_BACKOFF_S`.

    Attributes:
        usage: Totals over the policy's life: ``requests``, ``prompt_tokens``,
            ``completion_tokens``, ``total_tokens``, ``retries``, ``latency_s`` (sum
            over requests) and ``no_usage`` (answers without a usage field, whose
            tokens are not counted). Read it under no lock: it is replaced, not
            mutated, so a read sees one consistent state.
        calls: One dict per answered request, in the order answers came: ``seed``,
            ``prompt_tokens``, ``completion_tokens``, ``finish_reason``, ``latency_s``,
            ``attempts``.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str | None = None,
        temperature: float = 1.0,
        top_p: float | None = None,
        max_tokens: int = 256,
        seed: int | None = 0,
        stop: str | Sequence[str] | None = None,
        logprobs: bool = True,
        max_concurrent: int = 4,
        timeout_s: float = 60.0,
        retries: int = 2,
        backoff_s: float = 0.5,
    ) -> None:
        parts = urllib.parse.urlsplit(str(base_url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise OptionError(
                f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                f"got {base_url!r}"
            )
        if not model or not isinstance(model, str):
            raise OptionError(f"model must be the name the server serves, got {model!r}")
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise OptionError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if not (isinstance(max_concurrent, int) and max_concurrent >= 1):
            raise OptionError(f"max_concurrent must be an int >= 1, got {max_concurrent!r}")
        if not (isinstance(retries, int) and retries >= 0):
            raise OptionError(f"retries must be an int >= 0, got {retries!r}")
        if not float(timeout_s) > 0:
            raise OptionError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if not float(temperature) >= 0:
            raise OptionError(f"temperature must be >= 0, got {temperature!r}")
        if top_p is not None and not 0 < float(top_p) <= 1:
            raise OptionError(f"top_p must be in (0, 1], got {top_p!r}")
        if float(backoff_s) < 0:
            raise OptionError(f"backoff_s must be >= 0, got {backoff_s!r}")
        if seed is not None and not isinstance(seed, int):
            raise OptionError(f"seed must be an int or None, got {seed!r}")
        self.base_url = str(base_url).rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self._api_key: str | None = None
        if api_key_env is not None:
            key = os.environ.get(api_key_env, "")
            if not key.strip():
                raise EndpointAuthError(
                    f"the API key variable {api_key_env} is not set (or empty): export "
                    f"{api_key_env}=<key> before the run, or pass api_key_env=None for a "
                    "server that needs no key",
                    url=self.base_url,
                )
            self._api_key = key.strip()
        self.temperature = float(temperature)
        self.top_p = None if top_p is None else float(top_p)
        self.max_tokens = max_tokens
        self.seed = seed
        self.stop = [stop] if isinstance(stop, str) else (list(stop) if stop else None)
        self.logprobs = bool(logprobs)
        self.max_concurrent = max_concurrent
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        # A proxy from the environment would swallow loopback requests: go direct there.
        handlers = [urllib.request.ProxyHandler({})] if _is_loopback(parts.hostname) else []
        self._opener = urllib.request.build_opener(*handlers)
        self._lock = threading.Lock()
        # The cap holds across threads: a runner may call act from several at once.
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self.usage: dict[str, float] = {}
        self.calls: list[dict[str, Any]] = []
        self.reset_usage()

    def __repr__(self) -> str:  # never the key
        return f"EndpointPolicy(base_url={self.base_url!r}, model={self.model!r})"

    @property
    def url(self) -> str:
        """The chat-completions URL requests go to."""
        return self.base_url + "/chat/completions"

    def reset_usage(self) -> None:
        """Zero :attr:`usage` and empty :attr:`calls`."""
        with self._lock:
            self.usage = dict.fromkeys(
                (
                    "requests",
                    "prompt_tokens",
                    "completion_tokens",
                    "total_tokens",
                    "retries",
                    "no_usage",
                ),
                0,
            )
            self.usage["latency_s"] = 0.0
            self.calls = []

    # ------------------------------------------------------------------ the policy
    def act(
        self, requests: Sequence[ActRequest], rng: np.random.Generator
    ) -> list[list[ActionSample]]:
        """Ask the endpoint for ``request.n`` replies per request and parse each one."""
        jobs: list[tuple[int, ActRequest, int | None]] = []
        for i, req in enumerate(requests):
            if req.prefix_token_ids:
                raise EngineError(
                    "an OpenAI-compatible endpoint cannot continue a forced token prefix "
                    "(a fork inside a turn); branch between turns (gap_unit='steps') or "
                    "use an in-process engine"
                )
            for j in range(req.n):
                # One draw per sample from its own stream, whatever the settings, so the
                # stream advances the same way with or without seeds.
                draw = int(sample_rng(req, j, rng).integers(2**62))
                jobs.append((i, req, None if self.seed is None else self._mix(draw)))
        if not jobs:
            return [[] for _ in requests]
        workers = min(self.max_concurrent, len(jobs))
        if workers == 1:
            results = [self._sample(req, seed) for _, req, seed in jobs]
        else:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="endpoint")
            try:
                futures = [pool.submit(self._sample, req, seed) for _, req, seed in jobs]
                results = [f.result() for f in futures]
            finally:
                # On the first failure, queued requests are dropped, not sent.
                pool.shutdown(wait=True, cancel_futures=True)
        out: list[list[ActionSample]] = [[] for _ in requests]
        for (i, _, _), sample in zip(jobs, results, strict=True):
            out[i].append(sample)
        return out

    def _mix(self, draw: int) -> int:
        """The request seed from the base seed and the sample's draw (31 bits: every server)."""
        state = np.random.SeedSequence([int(self.seed or 0) & (2**63 - 1), draw])
        return int(state.generate_state(1, dtype=np.uint32)[0] & 0x7FFFFFFF)

    def _sample(self, req: ActRequest, seed: int | None) -> EndpointSample:
        builder = prompt_for(req.context.env_id)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": builder.messages(req.context),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if seed is not None:
            body["seed"] = seed
        if self.stop:
            body["stop"] = self.stop
        t0 = time.perf_counter()
        data, attempts = self._complete(body)
        latency = time.perf_counter() - t0
        choice = self._choice(data)
        message = choice.get("message")
        if not isinstance(message, dict):
            raise EndpointError(
                f"{self.url} answered a choice without a chat message ({str(choice)[:120]!r}); "
                "is it a chat-completions endpoint (not the legacy /completions)?",
                url=self.url,
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise EndpointError(
                f"{self.url} answered a message whose content is not text "
                f"({type(content).__name__}); is it an OpenAI-compatible chat endpoint?",
                url=self.url,
            )
        text = content or ""
        usage = data.get("usage")
        prompt_tokens = _count(usage, "prompt_tokens")
        completion_tokens = _count(usage, "completion_tokens")
        finish = choice.get("finish_reason")
        record = {
            "seed": seed,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "finish_reason": finish,
            "latency_s": latency,
            "attempts": attempts,
        }
        with self._lock:
            u = dict(self.usage)
            u["requests"] += 1
            u["retries"] += attempts - 1
            u["latency_s"] += latency
            if prompt_tokens is None and completion_tokens is None:
                u["no_usage"] += 1
            u["prompt_tokens"] += prompt_tokens or 0
            u["completion_tokens"] += completion_tokens or 0
            total = _count(usage, "total_tokens")
            u["total_tokens"] += (
                total if total is not None else (prompt_tokens or 0) + (completion_tokens or 0)
            )
            self.usage = u
            self.calls.append(record)
        parsed = builder.parse(text, req.context.current_info)
        return EndpointSample(
            action=parsed.action,
            text=text,
            token_ids=_EMPTY_I64.copy(),
            logprobs=_EMPTY_F32.copy(),
            entropies=_EMPTY_F32.copy(),
            parse_error=parsed.error,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish if isinstance(finish, str) else None,
            latency_s=latency,
            server_logprobs=self._logprobs_of(choice),
            seed=seed,
        )

    # ------------------------------------------------------------------ HTTP
    def _choice(self, data: Any) -> dict[str, Any]:
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise EndpointError(
                f"{self.url} answered JSON without a 'choices' list ({str(data)[:200]!r}); is "
                "base_url an OpenAI-compatible API root (usually ending in /v1)?",
                url=self.url,
            )
        return choices[0]

    @staticmethod
    def _logprobs_of(choice: dict[str, Any]) -> np.ndarray | None:
        lp = choice.get("logprobs")
        content = lp.get("content") if isinstance(lp, dict) else None
        if not isinstance(content, list):
            return None
        values = [t.get("logprob") for t in content if isinstance(t, dict)]
        if len(values) != len(content) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            return None
        return np.asarray(values, dtype=np.float32)

    def _complete(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """POST ``body`` with bounded retries; the answer's JSON and the tries it took."""
        attempt = 0
        while True:
            attempt += 1
            with_logprobs = self.logprobs
            try:
                payload = {**body, "logprobs": True} if with_logprobs else body
                with self._slots:
                    data = self._post(payload)
                return data, attempt
            except _Retryable as exc:
                if attempt > self.retries:
                    raise exc.error from None
                wait = self.backoff_s * 2 ** (attempt - 1)
                if exc.retry_after is not None:
                    wait = exc.retry_after
                time.sleep(min(max(wait, 0.0), MAX_BACKOFF_S))
            except EndpointError as exc:
                if with_logprobs and exc.status == 400 and "logprob" in str(exc).lower():
                    self.logprobs = False  # the server does not do log-probs: stop asking
                    attempt -= 1
                    continue
                raise

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise self._http_error(exc) from None
        except TimeoutError as exc:
            raise _Retryable(self._timeout_error()) from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise _Retryable(self._timeout_error()) from exc
            raise _Retryable(
                EndpointError(
                    f"cannot reach {self.url} ({exc.reason}); is the server running at "
                    f"{self.base_url}? Start it, e.g. vllm serve <model folder> --port <port> "
                    "(then base_url=http://127.0.0.1:<port>/v1), or fix base_url",
                    url=self.url,
                )
            ) from exc
        except (ConnectionError, OSError) as exc:  # reset or closed mid-answer
            raise _Retryable(
                EndpointError(
                    f"the connection to {self.url} broke ({exc}); is the server at "
                    f"{self.base_url} up and an OpenAI-compatible endpoint?",
                    url=self.url,
                )
            ) from exc
        except http.client.HTTPException as exc:  # bytes that are not an HTTP answer
            raise EndpointError(
                f"{self.url} did not answer HTTP ({type(exc).__name__}: {str(exc)[:120]}); is "
                f"base_url right, and is the server at {self.base_url} an OpenAI-compatible "
                "endpoint?",
                url=self.url,
            ) from None
        try:
            data = json.loads(raw)
        except ValueError:
            raise EndpointError(
                f"{self.url} answered something that is not JSON "
                f"({raw[:120].decode('utf-8', 'replace')!r}); is base_url the API root of an "
                "OpenAI-compatible server (usually ending in /v1)?",
                url=self.url,
            ) from None
        if not isinstance(data, dict):
            raise EndpointError(
                f"{self.url} answered JSON that is not an object ({str(data)[:120]!r}); is it "
                "an OpenAI-compatible chat endpoint?",
                url=self.url,
            )
        if "error" in data and "choices" not in data:
            raise EndpointError(
                f"{self.url} answered an error: {_server_message(raw)}", url=self.url
            )
        return data

    def _timeout_error(self) -> EndpointError:
        return EndpointError(
            f"{self.url} gave no answer within timeout_s={self.timeout_s:g} s; is the server "
            f"at {self.base_url} overloaded? Raise timeout_s or lower max_concurrent",
            url=self.url,
        )

    def _http_error(self, exc: urllib.error.HTTPError) -> Exception:
        status = exc.code
        try:
            detail = _server_message(exc.read())
        except OSError:
            detail = ""
        finally:
            exc.close()
        where = f"{self.url} answered HTTP {status}"
        if status in (401, 403):
            hint = (
                f"the key in {self.api_key_env} was refused; check it"
                if self.api_key_env
                else "the server wants an API key: pass api_key_env=<name of the variable "
                "that holds it>"
            )
            return EndpointAuthError(f"{where} ({detail}); {hint}", url=self.url, status=status)
        if status == 404:
            served = self._served_models()
            if served is not None and self.model not in served:
                return EndpointError(
                    f"{where}: the model {self.model!r} is not served at {self.base_url}; it "
                    f"serves {', '.join(served) or 'nothing'}: pass one of those as model",
                    url=self.url,
                    status=status,
                )
            return EndpointError(
                f"{where} ({detail}); is base_url the API root (usually ending in /v1), and "
                f"is {self.model!r} the model's served name?",
                url=self.url,
                status=status,
            )
        error = EndpointError(f"{where}: {detail}", url=self.url, status=status)
        if status in RETRY_STATUS:
            retry_after = exc.headers.get("Retry-After") if exc.headers else None
            try:
                after = float(retry_after) if retry_after is not None else None
            except ValueError:
                after = None
            return _Retryable(error, after)
        return error

    def _served_models(self) -> list[str] | None:
        """The model ids ``GET {base_url}/models`` lists, or ``None`` if it cannot say."""
        headers = {"Accept": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(self.base_url + "/models", headers=headers)
        try:
            with self._opener.open(request, timeout=min(self.timeout_s, 10.0)) as response:
                data = json.loads(response.read())
        except (OSError, ValueError):
            return None
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            return None
        return [str(e["id"]) for e in entries if isinstance(e, dict) and "id" in e]
