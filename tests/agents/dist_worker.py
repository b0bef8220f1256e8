"""Run under ``torchrun`` by test_distributed.py: two data parallel GRPO runs on gloo.

``python -m torch.distributed.run --standalone --nproc-per-node 2 dist_worker.py ROOT MODEL``
trains the saved tiny model ``MODEL`` into ``ROOT/full`` for two steps (a sharded
checkpoint after each), then resumes ``ROOT/full/checkpoint-000001`` into ``ROOT/resumed``
and trains its second step again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

OPTIONS = {
    "policy": "scoring",
    "env_kwargs": {"depth": 2},
    "steps": 2,
    "prompts_per_step": 2,
    "n": 4,
    "lr": 1e-3,
    "threads": 1,
    "checkpoint_every": 1,
    "progress": False,
}


def main(root: Path, model: str) -> None:
    """Both runs in one process group (the runs join it; neither ends it)."""
    from branchgym.agents.train import train

    dist.init_process_group("gloo")
    train("grpo", **OPTIONS, model=model, distributed="ddp", out_dir=str(root / "full"))
    train(
        "grpo",
        resume=str(root / "full" / "checkpoint-000001"),
        out_dir=str(root / "resumed"),
        distributed="ddp",
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
