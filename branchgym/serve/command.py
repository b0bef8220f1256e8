"""The ``branchgym serve`` command: argument parsing (no server imports until it runs)."""

from __future__ import annotations

import argparse
import json
import os

from branchgym.bench.common import positive_int
from branchgym.error import OptionError

__all__ = ["configure", "run"]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected positive seconds, got {text!r}")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    """Options of ``branchgym serve``."""
    p.add_argument("env_id", help="registered env id, e.g. branchgym/TextTreeMDP-v0")
    p.add_argument("--env-kwargs", default="{}", help="JSON object of branchgym.make kwargs")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default loopback)")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    p.add_argument(
        "--token",
        default=None,
        help="clients must send 'Authorization: Bearer TOKEN' (default: $BRANCHGYM_SERVE_TOKEN)",
    )
    p.add_argument("--max-sessions", type=positive_int, default=64)
    p.add_argument("--max-snapshots", type=positive_int, default=1024, help="per session")
    p.add_argument("--idle-timeout", type=_positive_float, default=600.0, help="seconds")
    p.add_argument("--max-message-bytes", type=positive_int, default=16 * 2**20)


def run(args: argparse.Namespace) -> int:
    """Build the server and serve until interrupted."""
    try:
        kwargs = json.loads(args.env_kwargs)
    except json.JSONDecodeError as exc:
        raise OptionError(f"--env-kwargs must be a JSON object: {exc}") from exc
    if not isinstance(kwargs, dict):
        raise OptionError(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
    if not 0 <= args.port <= 65535:
        raise OptionError(f"--port must be 0..65535, got {args.port}")
    token = args.token or os.environ.get("BRANCHGYM_SERVE_TOKEN") or None
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        raise OptionError(
            f"serving on {args.host} without a token lets anyone on the network run the env; "
            "give --token (or $BRANCHGYM_SERVE_TOKEN)"
        )
    # imported only now: OpenEnv's server stack takes seconds to import
    from branchgym.serve.server import BranchgymServer, ServeLimits, run_server

    limits = ServeLimits(
        max_sessions=args.max_sessions,
        max_snapshots_per_session=args.max_snapshots,
        idle_timeout=args.idle_timeout,
        max_message_bytes=args.max_message_bytes,
    )
    server = BranchgymServer(args.env_id, kwargs, token=token, limits=limits)
    run_server(server, args.host, args.port)
    return 0
