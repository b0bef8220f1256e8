"""Serve any registered env over OpenEnv's protocol, extended with snapshot, restore and fork.

* :mod:`branchgym.serve.wire`: the JSON codec for observations, actions, info and
  Gymnasium spaces, and the protocol's message types and error codes (no dependencies,
  shared by the server and its clients).
* :mod:`branchgym.serve.environment`: the env as an OpenEnv ``Environment`` and its models.
* :mod:`branchgym.serve.server`: the server (``branchgym serve``; ``pip install
  'branchgym[serve]'``), OpenEnv's FastAPI stack with branchgym's session WebSocket.

Clients: :class:`branchgym.remote.RemoteEnv` (one session, a ``SnapshottableEnv``) and
:class:`branchgym.rollout.fleet.FleetExecutor` (many sessions over many servers).
See docs/serving.md.
"""
