"""``branchgym bench trl`` times branchgym's learners and TRL's trainers in one run and
writes its report (the figures are measured by the study, never asserted here)."""

import json

import pytest

pytest.importorskip("torch")

from branchgym.bench import STUDIES  # noqa: E402
from branchgym.bench.trl_trainer import unique_tokens  # noqa: E402
from branchgym.cli import main  # noqa: E402

TRAINERS = {
    "single turn": {"branchgym grpo", "TRL GRPOTrainer"},
    "multi turn": {
        "branchgym grpo",
        "branchgym bpo",
        "branchgym bpo depths",
        "TRL BranchingGRPOTrainer",
    },
}


def test_unique_tokens_count_each_shared_prefix_once_per_group():
    # two rows sharing 3 tokens: 3 + 2 + 1; a group does not share with another
    assert unique_tokens([[[1, 2, 3, 4, 5], [1, 2, 3, 9]]]) == 6
    assert unique_tokens([[[1, 2]], [[1, 2]]]) == 4
    assert unique_tokens([[[7, 7], [7, 7]]]) == 2


@pytest.mark.slow
def test_trl_study_times_every_trainer_with_its_split_and_tokens(tmp_path, capsys):
    pytest.importorskip("trl")
    assert "trl" in STUDIES
    rc = main(["bench", "trl", "--quick", "--m", "1", "--k", "2", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "trl.json").read_text())
    assert {w: set(runs) for w, runs in data.items()} == TRAINERS
    for runs in data.values():
        for name, run in runs.items():
            assert len(run["step_s"]) == 2, name
            for phase in ("generation", "reference", "update"):
                assert all(0 < t < s for t, s in zip(run[phase], run["step_s"], strict=True)), (
                    name,
                    phase,
                )
            # a forward reads at least the unique tokens, and they hold what was generated
            for gen, learner, unique in zip(
                run["generated"], run["learner"], run["unique"], strict=True
            ):
                assert gen <= unique <= learner, name
        # branchgym packs each group's shared prompt: it reads the unique tokens only
        for name in runs:
            if name.startswith("branchgym"):
                assert runs[name]["learner"] == runs[name]["unique"], name
    # TRL reads the prompt once per completion: more than the unique tokens
    trl = data["single turn"]["TRL GRPOTrainer"]
    assert all(lr > u for lr, u in zip(trl["learner"], trl["unique"], strict=True))
    assert (tmp_path / "trl_step_time.png").exists()
    out = capsys.readouterr().out
    assert "single turn: branchgym grpo / TRL GRPOTrainer step time" in out
    assert "multi turn: branchgym bpo / TRL BranchingGRPOTrainer step time" in out
    assert "multi turn: branchgym bpo depths / branchgym grpo step time" in out


def test_trl_study_says_when_trl_is_missing(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a)
    )
    args = ["bench", "trl", "--quick", "--m", "1", "--k", "2", "--workloads", "single turn"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    assert "TRL is not installed" in capsys.readouterr().out
    data = json.loads((tmp_path / "trl.json").read_text())
    assert set(data["single turn"]) == {"branchgym grpo"}
    assert "TRL is not installed" in (tmp_path / "trl.md").read_text()


def _where_a_block_lands(n_bytes: int) -> dict[str, str]:
    """Per ``--malloc`` mode, where a fresh process's malloc of ``n_bytes`` lands.

    ``heap`` (inside glibc's ``[heap]`` mapping) or ``mapped`` (a mapping of its own).
    """
    import subprocess
    import sys

    code = f"""
import ctypes, sys
from branchgym.bench.trl_trainer import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
p = libc.malloc({n_bytes})
heap = [l.split()[0] for l in open("/proc/self/maps") if l.rstrip().endswith("[heap]")]
lo, hi = (int(x, 16) for x in heap[0].split("-"))
print("heap" if lo <= p < hi else "mapped")
"""
    out = {}
    for mode in ("glibc", "keep"):
        res = subprocess.run(
            [sys.executable, "-c", code, mode], capture_output=True, text=True, check=True
        )
        out[mode] = res.stdout.strip()
    return out


def test_keep_freed_memory_serves_large_blocks_from_the_heap():
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt and /proc/self/maps")
    # 64 MB is above glibc's largest mmap threshold: mapped on its own by default,
    # from the heap once keep_freed_memory has run
    assert _where_a_block_lands(64 << 20) == {"glibc": "mapped", "keep": "heap"}


def test_malloc_option_is_recorded_and_an_unknown_one_refused(tmp_path, capsys, monkeypatch):
    import importlib.util

    import branchgym.bench.trl_trainer as study

    calls = []
    monkeypatch.setattr(study, "keep_freed_memory", lambda: calls.append(1))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a)
    )
    args = ["bench", "trl", "--quick", "--m", "1", "--k", "2", "--workloads", "single turn"]
    assert main([*args, "--malloc", "keep", "--out", str(tmp_path)]) == 0
    assert calls == [1]
    assert "allocator (--malloc keep)" in capsys.readouterr().out
    assert "`--malloc keep`" in (tmp_path / "trl.md").read_text()
    with pytest.raises(SystemExit) as exc:
        main([*args, "--malloc", "tcmalloc", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "invalid choice: 'tcmalloc'" in capsys.readouterr().err


def test_keep_freed_memory_without_mallopt_says_the_fix(monkeypatch):
    import ctypes

    from branchgym.bench.trl_trainer import keep_freed_memory
    from branchgym.error import OptionError

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: object())  # a C library with no mallopt
    with pytest.raises(OptionError, match="--malloc glibc"):
        keep_freed_memory()


def test_other_time_is_the_median_of_each_steps_rest_never_negative():
    from branchgym.bench.trl_trainer import _row

    # steps 2-6 (step 1 is the warm-up) each leave 1 s outside the phases, but the
    # phases' medians (8 + 1 + 3) add up to more than the median step (11)
    run = {
        "step_s": [9.0, 10.0, 10.0, 11.0, 12.0, 13.0],
        "generation": [1.0, 8.0, 0.0, 8.0, 0.0, 8.0],
        "reference": [1.0] * 6,
        "update": [1.0, 0.0, 8.0, 1.0, 10.0, 3.0],
        "generated": [10] * 6,
        "learner": [20] * 6,
        "unique": [15] * 6,
    }
    step, gen, ref, upd, other = _row("t", run)[1:6]
    assert (step, gen, ref, upd) == (11.0, 8.0, 1.0, 3.0)
    assert other == 1.0  # not 11 - 12
