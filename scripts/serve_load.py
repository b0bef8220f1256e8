"""Load test of ``branchgym serve`` on loopback: concurrent sessions with snapshots and restores.

Starts one server in a child process, opens ``--clients`` RemoteEnv sessions at once
(one connection each), and has every client run ``--rounds`` rounds of
snapshot -> 2 steps -> restore -> step, releasing its snapshots as it goes. Prints the
p50/p99 latency of step, snapshot and restore, the server's memory before, at the peak
and after, and checks that no session or snapshot is left on the server once the
clients disconnect (exit 1 if any is). Bounded: every client stops at ``--seconds``.

    python scripts/serve_load.py --clients 64 --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from branchgym.remote import RemoteEnv
from branchgym.serve.process import ServerProcess

TOKEN = "load-test"


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def client(
    url: str, i: int, rounds: int, start: threading.Barrier, stop_at: float, out: dict
) -> None:
    """One session: reset, then rounds of snapshot/step/step/restore/step."""
    lat: dict[str, list[float]] = {"step": [], "snapshot": [], "restore": []}
    env = RemoteEnv(url, token=TOKEN)
    kept = []  # every other round's snapshot stays alive: released by the disconnect

    def step(info: dict) -> tuple:
        actions = info["admissible_actions"] or ["go north"]
        t = time.perf_counter()
        out = env.step(actions[len(lat["step"]) % len(actions)])
        lat["step"].append(time.perf_counter() - t)
        return out

    try:
        obs, info = env.reset(seed=i)
        start.wait()
        for r in range(rounds):
            if time.monotonic() > stop_at:
                break
            t = time.perf_counter()
            snap = env.snapshot()
            lat["snapshot"].append(time.perf_counter() - t)
            for _ in range(2):
                obs, _, term, trunc, info = step(info)
                if term or trunc:
                    break
            t = time.perf_counter()
            obs, info = env.restore(snap)
            lat["restore"].append(time.perf_counter() - t)
            obs, _, term, trunc, info = step(info)
            if term or trunc:
                obs, info = env.reset(seed=i + 1000 * (r + 1))
            if r % 2:
                kept.append(snap)
            else:
                snap.release()
        out[i] = lat
        start.wait()  # hold every session open until all are done (peak measured there)
        start.wait()
    finally:
        env.close()


def main(argv: list[str] | None = None) -> int:
    """Run the load test and print its figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seconds", type=float, default=120.0, help="stop every client after this")
    p.add_argument("--env", default="branchgym/TextTreeMDP-v0")
    args = p.parse_args(argv)
    opts = {"max_sessions": args.clients + 8}
    with ServerProcess(args.env, token=TOKEN, options=opts) as server:
        probe = RemoteEnv(server.url, token=TOKEN)
        before = probe.stats()
        start = threading.Barrier(args.clients + 1)
        out: dict[int, dict[str, list[float]]] = {}
        stop_at = time.monotonic() + args.seconds
        threads = [
            threading.Thread(
                target=client, args=(server.url, i, args.rounds, start, stop_at, out), daemon=True
            )
            for i in range(args.clients)
        ]
        for t in threads:
            t.start()
        start.wait(timeout=args.seconds)  # every session open and reset
        t0 = time.perf_counter()
        start.wait(timeout=args.seconds)  # every client done, sessions still open
        wall = time.perf_counter() - t0
        peak = probe.stats()
        start.wait(timeout=args.seconds)  # let them disconnect
        for t in threads:
            t.join(timeout=30)
        deadline = time.monotonic() + 30
        after = probe.stats()
        while (after["sessions"] or after["snapshots"]) and time.monotonic() < deadline:
            time.sleep(0.2)
            after = probe.stats()
        probe.close()
    lat = {k: [x for d in out.values() for x in d[k]] for k in ("step", "snapshot", "restore")}
    n_ops = sum(len(v) for v in lat.values())
    print(f"server: {args.env}, {args.clients} concurrent sessions (one connection each), "
          f"{len(out)} clients finished, {n_ops} timed calls in {wall:.1f} s "
          f"({n_ops / wall:.0f} calls/s)")  # fmt: skip
    print("| call | count | p50 ms | p99 ms | mean ms |")
    print("|---|---|---|---|---|")
    for name, values in lat.items():
        print(
            f"| {name} | {len(values)} | {1e3 * percentile(values, 0.5):.2f} | "
            f"{1e3 * percentile(values, 0.99):.2f} | {1e3 * statistics.fmean(values):.2f} |"
        )
    mib = 2**20
    print(
        f"server RSS: before {before['rss_bytes'] / mib:.1f} MiB, "
        f"peak {peak['rss_bytes'] / mib:.1f} MiB ({peak['sessions']} sessions, "
        f"{peak['snapshots']} snapshots,"
        f" {peak['snapshot_bytes'] / 1024:.0f} KiB held), after {after['rss_bytes'] / mib:.1f} MiB"
    )
    leaked = after["sessions"], after["snapshots"], after["live_snapshot_objects"]
    print(
        f"after disconnect: {leaked[0]} sessions, {leaked[1]} snapshots, "
        f"{leaked[2]} unreleased Snapshot objects on the server; "
        f"{after['instances']} env instances kept in its pool for reuse"
    )
    return 0 if leaked == (0, 0, 0) and len(out) == args.clients else 1


if __name__ == "__main__":
    sys.exit(main())
