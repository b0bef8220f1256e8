"""EndpointPolicy against a real OpenAI-compatible server (vLLM serving SmolLM2-135M).

The server comes from conftest.py's ``smollm2_server`` fixture. The bad-input tests at
the end need no model: nothing listening, a local socket that answers garbage or
nothing, a missing key variable; the wrong model name is the real server's 404.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import gymnasium as gym
import numpy as np
import pytest

import branchgym  # noqa: F401  (registers the envs)
from branchgym.agents.policies.prompts import prompt_for
from branchgym.error import EndpointAuthError, EndpointError, EngineError, OptionError
from branchgym.evaluation.endpoint import EndpointPolicy, EndpointSample
from branchgym.rollout.grow import group_rollouts
from branchgym.rollout.policy import ActRequest, Context, Policy

WEBSHOP = "branchgym/WebShop-v0"
MAZE = "branchgym/TextTreeMDP-v0"


def reset_context(env_id: str, seed: int = 0) -> Context:
    env = gym.make(env_id)
    try:
        obs, info = env.reset(seed=seed)
    finally:
        env.close()
    return Context(env_id, obs, info)


def raw_chat(base_url: str, body: dict) -> dict:
    """One chat completion straight over HTTP, bypassing EndpointPolicy."""
    req = urllib.request.Request(
        base_url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=60) as r:
        return json.loads(r.read())


# ---------------------------------------------------------------- against the real server
@pytest.mark.slow
def test_webshop_episodes_are_played_by_the_server(smollm2_server):
    policy = EndpointPolicy(
        smollm2_server.base_url,
        smollm2_server.model,
        temperature=1.0,
        max_tokens=32,
        seed=3,
        max_concurrent=1,  # one request at a time: the replay below sees the same batches
    )
    assert isinstance(policy, Policy)
    tree = group_rollouts(WEBSHOP, policy, n=2, seed=0, max_steps=2)

    nodes = list(tree.nodes)
    assert nodes, "no decision was taken"
    assert all(tree[i].done for i in tree.leaves())
    # every decision is one answered request; the counters add up
    assert policy.usage["requests"] == len(nodes) == len(policy.calls)
    assert policy.usage["completion_tokens"] > 0 and policy.usage["prompt_tokens"] > 0
    assert policy.usage["completion_tokens"] == sum(c["completion_tokens"] for c in policy.calls)
    assert all(0 < c["completion_tokens"] <= 32 for c in policy.calls)
    assert policy.usage["no_usage"] == 0 and policy.usage["latency_s"] > 0
    builder = prompt_for(WEBSHOP)
    for n in nodes:
        assert n.text.strip(), "an empty reply"
        assert n.token_ids.size == n.logprobs.size == n.entropies.size == 0
        parsed = builder.parse(n.text, (tree[n.parent].info if n.parent >= 0 else tree.info))
        assert (n.action, n.parse_error) == (parsed.action, parsed.error)

    # The first decisions' texts are what the server answers to their seeds: ask it again
    # directly (no EndpointPolicy) and get the same replies.
    ctx = Context(WEBSHOP, tree.observation, tree.info)
    firsts = sorted(n.text for n in nodes if n.parent < 0)
    assert len(firsts) == 2
    replayed = sorted(
        raw_chat(
            smollm2_server.base_url,
            {
                "model": smollm2_server.model,
                "messages": builder.messages(ctx),
                "temperature": 1.0,
                "max_tokens": 32,
                "seed": call["seed"],
            },
        )["choices"][0]["message"]["content"]
        for call in policy.calls[:2]
    )
    assert replayed == firsts


@pytest.mark.slow
def test_sampling_settings_reach_the_server(smollm2_server):
    ctx = reset_context(MAZE)
    url, model = smollm2_server.base_url, smollm2_server.model

    def texts(policy, rng_seed, n=3):
        (batch,) = policy.act([ActRequest(ctx, n=n)], np.random.default_rng(rng_seed))
        assert all(isinstance(s, EndpointSample) for s in batch)
        return [s.text for s in batch], batch

    # temperature 1 with seeds: the same streams give the same replies, others differ
    hot = EndpointPolicy(url, model, temperature=1.0, max_tokens=16, seed=11, max_concurrent=3)
    a, batch = texts(hot, 0)
    b, _ = texts(hot, 0)
    c, _ = texts(hot, 1)
    assert a == b
    assert a != c
    assert len({s.seed for s in batch}) == 3
    # the server's log-probs, one per generated token, kept beside the sample
    for s in batch:
        assert s.server_logprobs is not None
        assert s.server_logprobs.size == s.completion_tokens
        assert np.all(s.server_logprobs <= 0)

    # temperature 0: the same reply whatever the seed
    cold = EndpointPolicy(url, model, temperature=0.0, max_tokens=24, seed=11)
    g1, _ = texts(cold, 0, n=2)
    g2, _ = texts(cold, 5, n=1)
    assert g1[0] == g1[1] == g2[0]

    # max_tokens caps the reply
    short = EndpointPolicy(url, model, temperature=1.0, max_tokens=3, seed=0)
    _, batch = texts(short, 0)
    assert all(s.completion_tokens <= 3 and s.finish_reason == "length" for s in batch)
    assert short.usage["completion_tokens"] == sum(s.completion_tokens for s in batch)

    # stop: cut the greedy reply at one of its own later words
    greedy = g1[0]
    words = greedy.split()
    assert len(words) >= 3, greedy
    word = words[2]
    cut = EndpointPolicy(url, model, temperature=0.0, max_tokens=24, stop=[word])
    (cut_text,), (smp,) = texts(cut, 0, n=1)
    assert cut_text == greedy[: greedy.index(word)]
    assert smp.finish_reason == "stop"


@pytest.mark.slow
def test_unparseable_replies_become_the_envs_invalid_action(smollm2_server):
    # One token is never a whole search[...] or click[...] action.
    policy = EndpointPolicy(
        smollm2_server.base_url, smollm2_server.model, temperature=0.0, max_tokens=1
    )
    tree = group_rollouts(WEBSHOP, policy, n=2, seed=0, max_steps=2)
    nodes = list(tree.nodes)
    assert len(nodes) == 4
    for n in nodes:
        assert n.parse_error is not None, n.text
        assert n.action == prompt_for(WEBSHOP).parse(n.text).action
        assert n.info.get("invalid_action") is True
        assert str(n.observation).startswith("Invalid action")
        assert n.error is None  # the env answered; nothing crashed
    assert all(tree[i].truncated for i in tree.leaves())  # the step cap ended them


@pytest.mark.slow
def test_a_wrong_model_name_is_the_servers_404_naming_the_served_ones(smollm2_server):
    policy = EndpointPolicy(smollm2_server.base_url, "no-such-model", retries=0)
    with pytest.raises(EndpointError, match="'no-such-model' is not served.*smollm2") as err:
        policy.act([ActRequest(reset_context(MAZE))], np.random.default_rng(0))
    assert err.value.status == 404


# ---------------------------------------------------------------- bad input, no model
def test_nothing_listening_fails_fast_with_the_fix(unused_port):
    port = unused_port  # bound then closed: nothing listens there
    policy = EndpointPolicy(f"http://127.0.0.1:{port}/v1", "m", retries=2, backoff_s=0.05)
    t0 = time.perf_counter()
    with pytest.raises(EndpointError, match=f"is the server running at http://127.0.0.1:{port}"):
        policy.act([ActRequest(reset_context(MAZE))], np.random.default_rng(0))
    assert time.perf_counter() - t0 < 5
    assert policy.usage["requests"] == 0


class _Canned:
    """A loopback TCP server that answers every connection with fixed bytes (or nothing)."""

    def __init__(self, reply: bytes | None):
        self.reply = reply
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)  # accept wakes up to see `closing`
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self._held: list[socket.socket] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._closing.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(5)
            self.connections += 1
            conn.recv(65536)
            if self.reply is None:
                self._held.append(conn)  # never answer
                continue
            conn.sendall(self.reply)
            conn.close()

    def close(self):
        self._closing.set()
        self._thread.join(timeout=5)
        self.sock.close()
        for c in self._held:
            c.close()


@pytest.fixture
def canned():
    servers = []

    def make(reply):
        servers.append(_Canned(reply))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _http(status: str, body: bytes, ctype: str = "text/html") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (_http("200 OK", b"<html>hello</html>"), "not JSON"),
        (_http("200 OK", b'{"object": "list"}', "application/json"), "without a 'choices'"),
        (_http("200 OK", b"[1, 2]", "application/json"), "not an object"),
        (
            _http("200 OK", b'{"choices": [{"text": "hi"}]}', "application/json"),
            "without a chat message",
        ),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "did not answer HTTP"),
    ],
    ids=["html", "no-choices", "json-list", "legacy-completion", "not-http"],
)
def test_an_endpoint_answering_garbage_is_a_typed_error(canned, reply, match):
    server = canned(reply)
    policy = EndpointPolicy(server.url, "m", retries=2, backoff_s=0.01)
    with pytest.raises(EndpointError, match=match):
        policy.act([ActRequest(reset_context(MAZE))], np.random.default_rng(0))
    assert server.connections == 1  # garbage is not retried


def test_server_errors_are_retried_a_bounded_number_of_times(canned):
    server = canned(_http("503 Service Unavailable", b'{"error": {"message": "overloaded"}}'))
    policy = EndpointPolicy(server.url, "m", retries=2, backoff_s=0.01)
    with pytest.raises(EndpointError, match="HTTP 503: overloaded") as err:
        policy.act([ActRequest(reset_context(MAZE))], np.random.default_rng(0))
    assert err.value.status == 503
    assert server.connections == 3


def test_an_endpoint_that_never_answers_times_out(canned):
    server = canned(None)
    policy = EndpointPolicy(server.url, "m", timeout_s=0.3, retries=1, backoff_s=0.01)
    t0 = time.perf_counter()
    with pytest.raises(EndpointError, match="no answer within timeout_s=0.3"):
        policy.act([ActRequest(reset_context(MAZE))], np.random.default_rng(0))
    assert time.perf_counter() - t0 < 5
    assert server.connections == 2


def test_a_missing_api_key_variable_is_named(monkeypatch):
    monkeypatch.delenv("BRANCHGYM_TEST_ENDPOINT_KEY", raising=False)
    with pytest.raises(EndpointAuthError, match="BRANCHGYM_TEST_ENDPOINT_KEY is not set"):
        EndpointPolicy("http://127.0.0.1:9/v1", "m", api_key_env="BRANCHGYM_TEST_ENDPOINT_KEY")


class _Recorder(BaseHTTPRequestHandler):
    """A chat endpoint that refuses log-probs and records what it was sent."""

    seen: list[tuple[dict, str | None]] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((body, self.headers.get("Authorization")))
        if body.get("logprobs"):
            self._send(400, {"error": {"message": "logprobs are not supported"}})
        else:
            reply = {"choices": [{"message": {"content": "Action: go nowhere"}}]}
            self._send(200, reply)

    def _send(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_key_is_sent_and_a_server_without_logprobs_is_asked_without(monkeypatch):
    # Protocol plumbing only (the end-to-end tests above use the real server).
    monkeypatch.setenv("BRANCHGYM_TEST_ENDPOINT_KEY", "sk-test")
    _Recorder.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        policy = EndpointPolicy(url, "m", api_key_env="BRANCHGYM_TEST_ENDPOINT_KEY")
        assert "sk-test" not in repr(policy)
        ctx = reset_context(MAZE)
        (batch,) = policy.act([ActRequest(ctx, n=2)], np.random.default_rng(0))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert [s.text for s in batch] == ["Action: go nowhere"] * 2
    # an action that is not among the maze's exits: sent as is, with the reason
    assert batch[0].action == "go nowhere" and "not an admissible" in batch[0].parse_error
    assert batch[0].server_logprobs is None and batch[0].completion_tokens is None
    assert policy.logprobs is False and policy.usage["no_usage"] == 2
    assert all(auth == "Bearer sk-test" for _, auth in _Recorder.seen)
    assert sum(1 for body, _ in _Recorder.seen if body.get("logprobs")) >= 1
    assert [b for b, _ in _Recorder.seen if not b.get("logprobs")][0]["model"] == "m"


class _Slow(_Recorder):
    """A chat endpoint that takes 0.1 s per answer and counts the requests in flight."""

    lock = threading.Lock()
    in_flight = 0
    peak = 0

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
        time.sleep(0.1)
        with cls.lock:
            cls.in_flight -= 1
        self._send(200, {"choices": [{"message": {"content": "Action: go west"}}]})


def test_max_concurrent_caps_requests_across_threads():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        policy = EndpointPolicy(url, "m", max_concurrent=3)
        ctx = reset_context(MAZE)
        outs = []

        def play(seed):
            outs.append(policy.act([ActRequest(ctx, n=4)], np.random.default_rng(seed)))

        threads = [threading.Thread(target=play, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert len(outs) == 3 and all(len(o[0]) == 4 for o in outs)
    assert _Slow.peak == 3  # requests overlapped, never beyond the cap
    assert policy.usage["requests"] == 12


def test_forced_token_prefixes_and_bad_options_are_refused():
    policy = EndpointPolicy("http://127.0.0.1:9/v1", "m")
    with pytest.raises(EngineError, match="gap_unit='steps'"):
        policy.act(
            [ActRequest(reset_context(MAZE), prefix_token_ids=(1, 2))], np.random.default_rng(0)
        )
    with pytest.raises(OptionError, match="base_url"):
        EndpointPolicy("127.0.0.1:8000", "m")
    with pytest.raises(OptionError, match="max_concurrent"):
        EndpointPolicy("http://127.0.0.1:9/v1", "m", max_concurrent=0)
