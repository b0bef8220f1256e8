"""`branchgym serve` in other processes on loopback: RemoteEnv, the fleet executor, faults.

Every server is a real `branchgym serve` child process on an ephemeral loopback port;
clients are RemoteEnv, the fleet executor, and OpenEnv's own GenericEnvClient.
"""

import base64
import functools
import json
import subprocess
import sys
import time

import pytest

pytest.importorskip("openenv")
pytest.importorskip("websockets")

from branchgym.agents.policies.policy import TextPolicy  # noqa: E402
from branchgym.error import (  # noqa: E402
    ForeignSnapshotError,
    RemoteAuthError,
    RemoteError,
    ResetNeededError,
    SnapshotReleasedError,
)
from branchgym.fidelity.checks import check_env  # noqa: E402
from branchgym.fidelity.suite import check_snapshot_fidelity  # noqa: E402
from branchgym.remote import RemoteEnv  # noqa: E402
from branchgym.rollout.executor_base import EnvRecipe  # noqa: E402
from branchgym.rollout.executors import InProcessExecutor  # noqa: E402
from branchgym.rollout.fleet import FleetExecutor  # noqa: E402
from branchgym.rollout.grow import grow_tree  # noqa: E402
from branchgym.serve.process import ServerProcess  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "s3cret-token"
TEXT = "branchgym/TextTreeMDP-v0"
NOISY = {"transition_noise": 0.6, "reward_noise": 0.3}


@pytest.fixture(scope="module")
def servers():
    """Servers started together (their start-up is mostly imports): name -> ServerProcess."""
    specs = {
        "main": (NOISY, {"max_message_bytes": 65536}),
        "other": (NOISY, {}),
        "tight": ({}, {"max_sessions": 2, "max_snapshots": 2, "idle_timeout": 3}),
        "victim": ({}, {}),
        "fleet_victim": (NOISY, {}),
    }
    procs = {
        name: ServerProcess(TEXT, kwargs, token=TOKEN, options=opts).start()
        for name, (kwargs, opts) in specs.items()
    }
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def remote(server, **kw):
    return RemoteEnv(server.url, token=TOKEN, **kw)


def stats_of(server):
    env = remote(server)
    try:
        return env.stats()
    finally:
        env.close()


def wait_for(predicate, seconds=15.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    return predicate()


# ----------------------------------------------------------------------- RemoteEnv


def test_check_env_and_the_fidelity_suite_pass_on_a_served_env(servers):
    factory = functools.partial(remote, servers["main"])
    report = check_env(factory, seed=0)
    assert report.ok, str(report)
    fidelity = check_snapshot_fidelity(factory, max_examples=25, seed=1)
    assert fidelity.ok, str(fidelity)
    assert fidelity.restores > 0 and fidelity.snapshots > 0


def test_branchgym_check_and_gym_make_reach_a_served_env(servers, monkeypatch, capsys):
    import gymnasium as gym

    from branchgym.cli import main

    monkeypatch.setenv("BRANCHGYM_REMOTE_URL", servers["main"].url)
    monkeypatch.setenv("BRANCHGYM_SERVE_TOKEN", TOKEN)
    assert main(["check", "branchgym.remote:RemoteEnv", "--max-examples", "5"]) == 0
    out = capsys.readouterr().out
    assert "[PASS] portability" in out and "OK" in out
    make = functools.partial(
        gym.make, "branchgym.remote:branchgym/Remote-v0", url=servers["main"].url, token=TOKEN
    )
    env = make()
    assert isinstance(env.unwrapped, RemoteEnv)
    env.close()
    assert check_env(make, seed=3).ok


def test_snapshots_stay_on_the_server_and_are_released_there(servers):
    env = remote(servers["main"])
    try:
        obs, info = env.reset(seed=3)
        base = env.stats()["snapshots"]
        snap = env.snapshot()
        assert not snap.picklable and snap.kind.endswith("+remote") and snap.nbytes > 0
        assert env.stats()["snapshots"] == base + 1
        action = info["admissible_actions"][0]
        first = env.step(action)
        assert env.restore(snap) == (obs, info)
        assert env.step(action) == first
        snap.release()
        assert env.stats()["snapshots"] == base
        with pytest.raises(SnapshotReleasedError):
            env.restore(snap)
    finally:
        env.close()


def test_portable_snapshots_are_signed_bytes_that_restore_on_another_server(servers):
    a, b = remote(servers["main"], portable=True), remote(servers["other"], portable=True)
    try:
        obs, info = a.reset(seed=5)
        a.step(info["admissible_actions"][1])
        snap = a.snapshot()
        assert snap.picklable and isinstance(snap.payload, bytes)
        # both servers inherited this process's $BRANCHGYM_SNAPSHOT_KEY: b can verify it
        import pickle

        copy = pickle.loads(pickle.dumps(snap))
        assert b.restore(copy) == a.restore(snap)
        assert b.state_digest() == a.state_digest()
    finally:
        a.close()
        b.close()


def test_a_stock_openenv_client_resets_and_steps_a_served_env(servers):
    from openenv.core.generic_client import GenericEnvClient

    url = servers["main"].url.replace("ws://", "http://").removesuffix("/ws")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with GenericEnvClient(base_url=url, headers=headers).sync() as client:
        result = client.reset(seed=0)
        assert "maze" in result.observation["observation"] and result.done is False
        action = result.observation["info"]["admissible_actions"][0]
        result = client.step({"action": action})
        assert isinstance(result.observation["observation"], str)
        assert result.reward is not None
        state = client.state()
        assert state["step_count"] == 1 and state["env_id"] == TEXT
    # no token: refused in the protocol, as an OpenEnv error the client raises
    with GenericEnvClient(base_url=url).sync() as client:
        with pytest.raises(RuntimeError, match="UNAUTHORIZED"):
            client.reset()


# --------------------------------------------------------------------------- faults


def test_a_wrong_token_is_refused_and_the_server_keeps_serving(servers):
    with pytest.raises(RemoteAuthError, match="token"):
        RemoteEnv(servers["main"].url, token="wrong")
    with pytest.raises(RemoteAuthError):
        RemoteEnv(servers["main"].url, token="")
    import urllib.error
    import urllib.request

    http = servers["main"].url.replace("ws://", "http://").removesuffix("/ws")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{http}/branchgym/stats", timeout=10)
    assert err.value.code == 401
    req = urllib.request.Request(f"{http}/schema", headers={"Authorization": f"Bearer {TOKEN}"})
    assert "action" in json.loads(urllib.request.urlopen(req, timeout=10).read())
    assert stats_of(servers["main"])["env_id"] == TEXT


def test_malformed_messages_get_typed_errors_and_the_connection_goes_on(servers):
    env = remote(servers["main"])
    conn = env.connection
    try:
        cases = {
            "{not json": "INVALID_JSON",
            "[1, 2]": "VALIDATION_ERROR",
            '{"type": "teleport"}': "UNKNOWN_TYPE",
            '{"type": "step", "data": {"action": "go north"}}': "UNKNOWN_SESSION",  # no reset
            '{"type": "reset", "data": 5}': "VALIDATION_ERROR",
            '{"type": "reset", "data": {}, "extra": 1}': "VALIDATION_ERROR",  # OpenEnv's model
            '{"type": "step", "data": {"wrong": 1}}': "VALIDATION_ERROR",
            '{"type": "restore", "data": {"snapshot_id": 7}}': "VALIDATION_ERROR",
            '{"type": "restore", "data": {"blob": "@@@"}}': "VALIDATION_ERROR",
            '{"type": "batch", "data": {"calls": 3}}': "VALIDATION_ERROR",
        }
        for text, code in cases.items():
            answer = conn.send_raw(text)
            assert answer["type"] == "error" and answer["data"]["code"] == code, (text, answer)
            assert answer["data"]["message"]
        env.reset(seed=0)
        answer = conn.send_raw('{"type": "step", "data": {"wrong": 1}}')
        assert answer["data"]["code"] == "VALIDATION_ERROR"
        # a tampered portable blob: the signature check refuses it, typed
        blob = base64.b64encode(b"BGSNAP2\x00" + b"\x00" * 40).decode()
        answer = conn.send_raw(json.dumps({"type": "restore", "data": {"blob": blob}}))
        assert answer["data"]["error_type"] == "SnapshotUntrustedError"
        assert env.step("go north")[0]  # the same connection still serves
    finally:
        env.close()


def test_oversized_messages(servers):
    env = remote(servers["main"])  # limit 64 KiB
    try:
        env.reset(seed=0)
        big = json.dumps({"type": "step", "data": {"action": "x" * 100_000}})
        answer = env.connection.send_raw(big)
        assert answer["data"]["code"] == "MESSAGE_TOO_LARGE"
        assert env.step("go north")[0]  # answered in the protocol: the connection goes on
        huge = json.dumps({"type": "step", "data": {"action": "x" * 400_000}})
        with pytest.raises(RemoteError) as err:  # past 4x the limit the transport closes
            env.connection.request(json.loads(huge))
        assert err.value.code in ("MESSAGE_TOO_LARGE", "CONNECTION_LOST")
    finally:
        env.close()
    assert stats_of(servers["main"])["env_id"] == TEXT  # the server keeps serving


def test_unknown_and_foreign_snapshot_ids(servers):
    a, b = remote(servers["main"]), remote(servers["other"])
    try:
        a.reset(seed=0)
        b.reset(seed=0)
        snap = a.snapshot()
        with pytest.raises(ForeignSnapshotError, match="valid on its own server only"):
            b.restore(snap)  # refused by the client: another server's id
        foreign = snap.payload.snapshot_id
        answer = b.connection.send_raw(
            json.dumps({"type": "restore", "data": {"snapshot_id": foreign}})
        )
        assert answer["data"]["code"] == "FOREIGN_SNAPSHOT"  # and by the server
        unknown = f"{a.server_id}:999999"
        answer = a.connection.send_raw(
            json.dumps({"type": "restore", "data": {"snapshot_id": unknown}})
        )
        assert answer["data"]["code"] == "UNKNOWN_SNAPSHOT"
        with pytest.raises(ForeignSnapshotError):
            a.connection.request({"type": "fork", "data": {"snapshot_id": unknown}})
        # another connection to the same server may restore it (same token, same server)
        c = remote(servers["main"])
        try:
            assert c.restore(snap) == a.restore(snap)
        finally:
            c.close()
        snap.release()
    finally:
        a.close()
        b.close()


def test_a_step_after_the_episode_ended_is_refused(servers):
    env = remote(servers["main"])
    try:
        obs, info = env.reset(seed=0)
        snap = env.snapshot()
        done = False
        while not done:
            obs, r, term, trunc, info = env.step(info["admissible_actions"][0])
            done = term or trunc
        with pytest.raises(ResetNeededError, match="episode is over"):
            env.step(info["admissible_actions"][0] if info["admissible_actions"] else "go north")
        env.restore(snap)  # a restore to a live state lifts it
        assert env.step("go north")
        snap.release()
    finally:
        env.close()


def test_limits_sessions_snapshots_and_idle_timeout(servers):
    tight = servers["tight"]  # 2 sessions, 2 snapshots per session, 3 s idle
    a, b = remote(tight), remote(tight)
    try:
        a.reset(seed=0)
        b.reset(seed=0)
        c = remote(tight)
        with pytest.raises(RemoteError) as err:
            c.reset(seed=0)
        assert err.value.code == "CAPACITY_REACHED"
        c.close()
        s1, s2 = a.snapshot(), a.snapshot()
        with pytest.raises(RemoteError) as err:
            a.snapshot()
        assert err.value.code == "SNAPSHOT_LIMIT"
        s1.release()
        a.snapshot().release()  # room again
        s2.release()
        time.sleep(4.5)  # both idle past the timeout: closed, everything released
        with pytest.raises(RemoteError) as err:
            a.step("go north")
        assert err.value.code in ("IDLE_TIMEOUT", "CONNECTION_LOST")
    finally:
        a.close()
        b.close()
    stats = wait_for(lambda: (s := stats_of(tight))["sessions"] == 0 and s)
    assert stats["sessions"] == 0 and stats["snapshots"] == 0


CLIENT = """
import sys, time
from branchgym.remote import RemoteEnv
env = RemoteEnv(sys.argv[1], token=sys.argv[2])
obs, info = env.reset(seed=0)
snaps = [env.snapshot() for _ in range(3)]
env.step(info["admissible_actions"][0])
print("ready", flush=True)
time.sleep(600)
"""


def test_a_client_killed_mid_episode_has_its_session_and_snapshots_released(servers):
    server = servers["other"]
    before = stats_of(server)
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.url, TOKEN], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        during = stats_of(server)
        assert during["snapshots"] == before["snapshots"] + 3
        assert during["sessions"] == before["sessions"] + 1
    finally:
        proc.kill()
        proc.wait()
    after = wait_for(lambda: (s := stats_of(server))["snapshots"] == before["snapshots"] and s)
    assert after["snapshots"] == before["snapshots"]
    assert after["sessions"] == before["sessions"]
    assert after["live_snapshot_objects"] == before["live_snapshot_objects"]


# ----------------------------------------------------------------------- trees


def grow(spec, executor, **kw):
    kw = {"m": 2, "k": 4, "seed": 0, "rng": 3, "schedule_options": {"gap_unit": "steps"}, **kw}
    return grow_tree(spec, TextPolicy(), "entropy", executor=executor, **kw)


def summary(tree):
    paths = [
        tuple((tree[i].step, tree[i].action, tree[i].observation, tree[i].reward,
               tree[i].done, tree[i].error, tree[i].sibling) for i in path)
        for path in tree.paths()
    ]  # fmt: skip
    return sorted(paths, key=repr)


def test_a_tree_grown_over_two_servers_equals_the_in_process_tree(servers):
    spec = EnvRecipe(TEXT, NOISY)
    urls = [servers["main"].url, servers["other"].url]
    before = [stats_of(servers[n]) for n in ("main", "other")]
    def resets(fleet):
        return [s["messages"].get("reset", 0) for s in fleet.stats()]

    with FleetExecutor(urls, token=TOKEN) as fleet:
        start = resets(fleet)
        tree = grow(spec, fleet, seed=0)
        assert summary(tree) == summary(grow(spec, None, seed=0))
        assert tree.stats.errors == 0
        # siblings follow their snapshots: the whole tree lived on the first server
        first = resets(fleet)
        assert first[0] > start[0] and first[1] == start[1]
        hold = fleet.reset([spec], [99])[0].session  # the first server is busier now
        tree = grow(spec, fleet, seed=1)
        assert summary(tree) == summary(grow(spec, None, seed=1))
        assert resets(fleet)[1] > first[1]  # the new tree went to the least-loaded server
        fleet.close([hold])
        assert fleet.live_snapshots().count == 0  # every snapshot released on the servers
    # portable snapshots: any server restores them, so one tree spreads over both
    with FleetExecutor(urls, token=TOKEN, portable=True) as fleet:
        before_forks = [s["messages"].get("fork", 0) for s in fleet.stats()]
        tree = grow(spec, fleet, seed=2, max_concurrent=None)
        assert summary(tree) == summary(grow(spec, None, seed=2))
        forks = [s["messages"].get("fork", 0) for s in fleet.stats()]
        assert all(a > b for a, b in zip(forks, before_forks, strict=True)), forks
    after = [stats_of(servers[n]) for n in ("main", "other")]
    for b, a in zip(before, after, strict=True):
        assert a["sessions"] == b["sessions"] and a["snapshots"] == b["snapshots"]
    # RemoteEnv instances through the in-process executor grow the same tree too
    factory = functools.partial(remote, servers["main"])
    tree = grow(EnvRecipe("remote", factory=factory), InProcessExecutor(max_instances=2))
    assert summary(tree) == summary(grow(spec, None))


class KillAfter(TextPolicy):
    """A policy that kills a server after ``n`` decisions (a crash mid-tree)."""

    def __init__(self, server, n):
        super().__init__()
        self.server, self.n, self.calls = server, n, 0

    def act(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            self.server.kill()
        return super().act(*args, **kwargs)


def test_a_server_killed_mid_tree_gives_error_leaves_with_reasons(servers):
    spec = EnvRecipe(TEXT, NOISY)
    # the victim first: the tree starts there (the least-loaded, first server)
    fleet = FleetExecutor([servers["fleet_victim"].url, servers["main"].url], token=TOKEN)
    try:
        policy = KillAfter(servers["fleet_victim"], 4)
        t0 = time.monotonic()
        kw = {"m": 2, "k": 4, "seed": 0, "rng": 3, "schedule_options": {"gap_unit": "steps"}}
        tree = grow_tree(spec, policy, "entropy", executor=fleet, **kw)
        assert time.monotonic() - t0 < 120  # no hang
        failed = [n for n in tree if n.error]
        assert failed and all("lost" in n.error for n in failed), [n.error for n in failed]
        assert any("CONNECTION_LOST" in n.error or "server" in n.error for n in failed)
        assert fleet.servers == [servers["main"].url]  # the dead one is dropped
        # the fleet goes on with the survivor
        again = grow(spec, fleet, seed=1)
        assert again.stats.errors == 0
    finally:
        fleet.shutdown()


def test_a_server_killed_under_remote_envs_gives_error_leaves(servers):
    victim = servers["victim"]
    factory = functools.partial(remote, victim, timeout=30)
    policy = KillAfter(victim, 3)
    kw = {"m": 2, "k": 4, "seed": 0, "rng": 3, "schedule_options": {"gap_unit": "steps"}}
    t0 = time.monotonic()
    tree = grow_tree(
        EnvRecipe("remote", factory=factory), policy, "entropy",
        executor=InProcessExecutor(max_instances=2), **kw,
    )  # fmt: skip
    assert time.monotonic() - t0 < 120
    failed = [n for n in tree if n.error]
    assert failed
    assert all("RemoteError" in n.error or "lost" in n.error for n in failed), [
        n.error for n in failed
    ]


def test_a_fleet_server_that_comes_back_is_used_again(servers):
    """A dropped server is dialled again; once it answers, new trees go to it."""
    from urllib.parse import urlparse

    spec = EnvRecipe(TEXT, NOISY)
    first = ServerProcess(TEXT, NOISY, token=TOKEN).start()
    url = first.wait_ready()
    back = None
    fleet = FleetExecutor([url, servers["main"].url], token=TOKEN, reconnect_interval=0.2)
    try:
        first.kill()
        with pytest.raises(RuntimeError, match="lost"):  # its root reset went to the dead one
            grow(spec, fleet, seed=0)
        assert fleet.servers == [servers["main"].url]
        calm = grow(spec, fleet, seed=1)  # the next tree goes to the survivor
        assert calm.stats.errors == 0 and fleet.reconnects == 0
        port = urlparse(url).port
        back = ServerProcess(TEXT, NOISY, token=TOKEN, options={"port": port}).start()
        assert back.wait_ready() == url
        time.sleep(0.3)  # past the reconnect interval

        def resets():
            return [s["messages"].get("reset", 0) if s else None for s in fleet.stats()]

        again = grow(spec, fleet, seed=2)
        assert again.stats.errors == 0
        assert fleet.reconnects == 1 and fleet.servers == [url, servers["main"].url]
        assert summary(again) == summary(grow(spec, None, seed=2))
        assert resets()[0] > 0  # the tree was grown on the server that came back
    finally:
        fleet.shutdown()
        first.stop()
        if back is not None:
            back.stop()


def test_pooled_remote_envs_outlive_the_servers_idle_timeout(servers):
    """The server closes idle connections; a pooled env reconnects on its next reset."""
    tight = servers["tight"]  # 3 s idle timeout
    spec = EnvRecipe("remote", factory=functools.partial(remote, tight))
    pool = InProcessExecutor(max_instances=1)
    try:
        first = grow(spec, pool, m=1, k=2)
        time.sleep(4.5)  # the pooled env's connection passes the idle timeout
        again = grow(spec, pool, m=1, k=2)
        assert again.stats.errors == 0 and summary(again) == summary(first)
    finally:
        pool.shutdown()
    env = remote(tight)
    try:
        env.reset(seed=0)
        time.sleep(4.5)
        with pytest.raises(RemoteError) as err:  # the session's state went with it
            env.step("go north")
        assert err.value.code in ("IDLE_TIMEOUT", "CONNECTION_LOST")
        obs, info = env.reset(seed=0)  # a new episode needs nothing the server held
        assert env.reopened == 1 and info["admissible_actions"]
        env.step(info["admissible_actions"][0])
    finally:
        env.close()
    with pytest.raises(RemoteError, match="was closed"):
        env.reset(seed=0)
    stats = wait_for(lambda: (s := stats_of(tight))["sessions"] == 0 and s)
    assert stats["sessions"] == 0
