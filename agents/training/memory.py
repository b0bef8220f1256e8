"""The memory model of a training run: what one GPU must hold, and the pieces that shrink it.

* :func:`estimate` / :func:`plan_for_args`: a :class:`MemoryPlan` (weights, KL reference,
  gradients, master weights, AdamW state, activations of one micro-batch) for a model
  given by its config alone (:func:`model_shape`: parameters counted on the ``meta``
  device, no weights read). ``branchgym train ... --dry-run`` prints it
  (docs/learners.md, Memory).
* :class:`MasterWeights`: ``precision=bf16``: bfloat16 parameters and gradients, float32
  master copies that AdamW updates.
* :func:`training_mode`: the training forward in train mode (so gradient checkpointing
  applies) with dropout off; sampling keeps eval mode.
* :func:`token_chunks`: micro-batches by token budget, which may split prompt groups.
* :func:`measure_peak`: the measured peak of a function (torch's allocator-level
  ``MemTracker``, CPU included), what the tests check the estimate against.

The activation coefficients are fitted to measured peaks of Qwen2 decoder layers
(torch's SDPA attention) in float32 and bfloat16 and checked by
``tests/agents/test_memory.py`` on shapes they were not fitted on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from branchgym.error import DataError, DependencyMissingError, TrainingConfigError

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.training.memory", "llm", "torch"
    ) from exc

__all__ = [
    "GIB",
    "SHAPES",
    "MasterWeights",
    "MemoryPlan",
    "ModelShape",
    "attention_path",
    "estimate",
    "measure_peak",
    "model_shape",
    "plan_for_args",
    "token_chunks",
    "training_mode",
]

GIB = 1024**3

#: Configs of common models by Hub id, for planning without their files (``--dry-run``).
SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-7B-Instruct": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen2.5-1.5B-Instruct": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-14B-Instruct": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "HuggingFaceTB/SmolLM2-135M-Instruct": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}
SHAPES["Qwen/Qwen2.5-7B"] = SHAPES["Qwen/Qwen2.5-7B-Instruct"]
SHAPES["smollm2"] = SHAPES["HuggingFaceTB/SmolLM2-135M-Instruct"]

#: Bytes per token per decoder layer kept for backward: ``e * (7 h + 3.4 I + 2 kv) + 9 h``
#: (``e`` the compute dtype's bytes; the last term is RMSNorm's float32 statistics).
#: Fitted to measured Qwen2 layers (SDPA); see the module docstring.
LAYER_COEFFS = {"hidden": 7.0, "intermediate": 3.4, "kv": 2.0, "fp32_hidden": 9.0}


@dataclasses.dataclass
class ModelShape:
    """What the memory model needs of a model: sizes, counted from its config.

    Attributes:
        name: Where the config came from.
        params: Parameters of the model.
        lora_params: Parameters LoRA adds (0 without LoRA).
        layers, hidden, intermediate, kv, vocab: Decoder layers, hidden size, MLP width,
            key/value width (heads x head dim), vocabulary.
    """

    name: str
    params: int
    lora_params: int
    layers: int
    hidden: int
    intermediate: int
    kv: int
    vocab: int


def _config(name: str) -> tuple[Any, str]:
    from transformers import AutoConfig, PretrainedConfig

    if str(name) == "tiny":
        from branchgym.agents.policies.models import tiny_qwen2

        return tiny_qwen2()[0].config, "tiny (agents/policies/models.py)"
    folder = Path(name)
    if (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(folder), str(folder / "config.json")
    from branchgym.agents.policies.hub import is_hub_id, resolve_hub_id

    if is_hub_id(str(name)):
        try:  # a Hub id in the local Hugging Face cache (offline)
            cached = resolve_hub_id(str(name))
            return AutoConfig.from_pretrained(cached), f"{name} (Hugging Face cache)"
        except (DataError, OSError, ValueError):
            if str(name) not in SHAPES:
                raise
    if str(name) in SHAPES:
        values = dict(SHAPES[str(name)])
        model_type = values.pop("model_type")
        cls = type(AutoConfig.for_model(model_type))
        config: PretrainedConfig = cls(**values)
        return config, f"{name} (built-in shape, agents/training/memory.py SHAPES)"
    raise DataError(
        f"no config for model {name!r}: give 'tiny', a model folder with config.json, a "
        f"Hub id in the local Hugging Face cache, or one of {', '.join(sorted(SHAPES))}."
    )


def model_shape(name: str, *, lora_rank: int = 0, lora_targets: Sequence[str] = ()) -> ModelShape:
    """Sizes of model ``name`` from its config alone (parameters counted on ``meta``)."""
    from transformers import AutoModelForCausalLM

    config, where = _config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    lora = 0
    if lora_rank:
        for mod_name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and mod_name.split(".")[-1] in lora_targets:
                lora += lora_rank * (module.in_features + module.out_features)
        if not lora:
            raise TrainingConfigError(
                f"lora_targets {tuple(lora_targets)} name no linear layer of {name}; use its "
                "module names (q_proj, v_proj, ... for Qwen2 and Llama)."
            )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(
        where,
        params,
        lora,
        config.num_hidden_layers,
        config.hidden_size,
        config.intermediate_size,
        kv_heads * head_dim,
        config.vocab_size,
    )


@dataclasses.dataclass
class MemoryPlan:
    """Bytes one training process holds at its peak, by part.

    Attributes:
        shape: The model.
        settings: The options that decided it (for the printout).
        parts: ``(name, bytes, how it was counted)`` in order.
    """

    shape: ModelShape
    settings: dict[str, Any]
    parts: list[tuple[str, int, str]]

    @property
    def total(self) -> int:
        """Sum of the parts."""
        return sum(b for _, b, _ in self.parts)

    def get(self, name: str) -> int:
        """Bytes of part ``name``."""
        return next(b for n, b, _ in self.parts if n == name)

    def fits(self, gib: float, headroom: float = 0.9) -> bool:
        """Whether the total stays under ``headroom`` of a ``gib`` GiB device."""
        return self.total <= headroom * gib * GIB

    def table(self, devices: Sequence[float] = (80, 141)) -> str:
        """The plan as text: settings, one line per part, the total and what it fits."""
        s = self.shape
        lines = [
            f"memory plan: {s.name}",
            f"  {s.params / 1e9:.2f} B parameters, {s.layers} layers, hidden {s.hidden}, "
            f"vocab {s.vocab}"
            + (f", LoRA adds {s.lora_params / 1e6:.1f} M" if s.lora_params else ""),
            "  " + ", ".join(f"{k}={v}" for k, v in self.settings.items()),
        ]
        for name, b, note in self.parts:
            lines.append(f"  {name:<22}{b / GIB:>9.2f} GiB  {note}")
        lines.append(f"  {'total':<22}{self.total / GIB:>9.2f} GiB")
        for gib in devices:
            verdict = "fits" if self.fits(gib) else "does NOT fit"
            lines.append(f"  {verdict} one {gib:g} GB GPU (90% usable)")
        return "\n".join(lines)


def estimate(
    shape: ModelShape,
    *,
    precision: str = "bf16",
    lora: bool = False,
    gradient_checkpointing: bool = False,
    tokens: int = 8192,
    targets: int | None = None,
    longest: int | None = None,
    masked: bool = True,
    reference: bool = False,
    device: str = "cuda",
    path: str | None = None,
) -> MemoryPlan:
    """The :class:`MemoryPlan` of one optimizer update with micro-batches of ``tokens``.

    Args:
        shape: The model (:func:`model_shape`; ``lora_params`` set when ``lora``).
        precision: ``auto`` (float32 weights, bfloat16 autocast on CUDA, which keeps a bf16
            copy of every weight while it runs), ``fp32`` or ``bf16`` (bf16 weights and
            gradients, float32 masters of what trains).
        lora: Only the LoRA adapters train (float32), the base weights are frozen.
        gradient_checkpointing: Keep each layer's input only; recompute one layer at a time.
        tokens: Tokens of one forward/backward pass (``micro_batch_tokens``).
        targets: Scored tokens of that pass (the ones the output layer sees; default all).
        longest: Longest sequence of the pass (its attention mask is ``longest**2``).
        masked: Whether the pass has side branches (tree packing, the scoring policy), so
            its attention is masked per pair of tokens.
        path: The attention path of such a pass (:func:`attention_path`): ``flat`` (tree
            attention per piece: its padded piece masks, bounded by the dense mask's
            pairs), ``levels`` (a key/value-cache read or the dense mask, whichever
            ``best_cut`` prices lower: the dense mask bounds it) or ``dense`` (one 4-D
            mask); default ``dense`` when ``masked``.
        reference: A KL reference model is held (with LoRA it costs nothing: the base
            model with the adapters off).
        device: ``cuda`` or ``cpu`` (autocast only happens on CUDA).
    """
    n, tn = shape.params, shape.lora_params
    targets = tokens if targets is None else targets
    longest = tokens if longest is None else longest
    compute = 2 if precision == "bf16" or (precision == "auto" and device == "cuda") else 4
    weight_bytes = 2 if precision == "bf16" else 4
    parts: list[tuple[str, int, str]] = []
    parts.append(("weights", n * weight_bytes, f"{n / 1e9:.2f} B x {weight_bytes} B"))
    if precision == "auto" and device == "cuda":
        parts.append(("autocast copies", n * 2, "bf16 copy of each weight under autocast"))
    trainable = tn if lora else n
    if lora:
        parts.append(("LoRA adapters", tn * 4, f"{tn / 1e6:.1f} M x 4 B (float32)"))
    if reference and not lora:
        parts.append(("KL reference", n * weight_bytes, "a frozen copy of the weights"))
    elif reference:
        parts.append(("KL reference", 0, "the base model with adapters off (no copy)"))
    grad_bytes = 4 if lora else weight_bytes
    parts.append(("gradients", trainable * grad_bytes, f"{grad_bytes} B per trained weight"))
    if precision == "bf16" and not lora:
        parts.append(("master weights", n * 8, "float32 copy and its float32 gradient"))
    parts.append(("AdamW state", trainable * 8, "two float32 moments per trained weight"))
    c = LAYER_COEFFS
    per_layer = tokens * int(
        compute * (c["hidden"] * shape.hidden + c["intermediate"] * shape.intermediate)
        + compute * c["kv"] * shape.kv
        + c["fp32_hidden"] * shape.hidden
    )
    attention = longest * longest * (1 + compute) if masked else 0
    if gradient_checkpointing:
        layers = shape.layers * tokens * shape.hidden * compute + per_layer + attention
        how = f"{shape.layers} layer inputs + 1 layer recomputed"
    else:
        layers = shape.layers * (per_layer + attention)
        how = f"{shape.layers} layers kept for backward"
    if masked:
        path = path or "dense"
        how += {
            "flat": f", tree attention per piece (at most {longest}^2 pairs)",
            "levels": f", cache reads or a 4-D mask {longest}^2",
            "dense": f", 4-D mask {longest}^2",
        }[path]
    else:
        path = "causal"
    parts.append((f"activations ({tokens} tok)", layers, how))
    head = targets * shape.vocab * (compute + 4) + tokens * shape.hidden * (compute + 4)
    parts.append(("logits", head, f"{targets} scored tokens x vocab, float32 log-softmax"))
    backward = tokens * compute * (4 * shape.hidden + 2 * shape.intermediate)
    parts.append(("backward buffers", backward, "activation gradients in flight"))
    settings = {
        "precision": precision,
        "lora": lora,
        "gradient_checkpointing": gradient_checkpointing,
        "micro_batch_tokens": tokens,
        "attention": path,
        "KL reference": reference,
    }
    return MemoryPlan(shape, settings, parts)


def attention_path(name: str, gradient_checkpointing: bool = False) -> str:
    """The attention path the learners' packed forward takes for model ``name``.

    The forward decides it per model (:func:`~branchgym.agents.forward.packed.packed_forward`):
    ``flat`` where :func:`~branchgym.agents.forward.flat.flat_supported` holds, else
    ``levels`` where :func:`~branchgym.agents.forward.levels.levels_supported` does,
    else ``dense``. Both checks are asked here of a one-layer, narrow model of the same
    class and configuration (random weights, built in milliseconds), so the plan and the
    training pass take the same path; gradient checkpointing rules both out (a recomputed
    layer runs outside the pass).
    """
    if gradient_checkpointing:
        return "dense"
    from transformers import AutoModelForCausalLM

    from branchgym.agents.forward.flat import flat_supported
    from branchgym.agents.forward.levels import levels_supported
    from branchgym.agents.forward.packed import backbone

    config, _ = _config(name)
    small = dict(config.to_dict())
    small.pop("layer_types", None)  # recomputed for the one layer
    small.update(num_hidden_layers=1, hidden_size=32, intermediate_size=64, vocab_size=128,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    try:
        model = AutoModelForCausalLM.from_config(type(config)(**small)).eval()
    except (TypeError, ValueError):  # a configuration that cannot shrink: the safe bound
        return "dense"
    base = backbone(model)[0]
    if flat_supported(model, base):
        return "flat"
    return "levels" if levels_supported(model, base) else "dense"


def plan_for_args(args: Any, *, reference: bool, device: str | None = None) -> MemoryPlan:
    """The plan of a learner's Args (``branchgym train ... --dry-run``).

    The micro-batch is ``micro_batch_tokens`` (or, when 0, :data:`FORWARD_TOKENS`, the
    largest pass the forward code builds); every token is counted as scored (an upper
    bound); with tree packing or the scoring policy the pass's attention takes the path
    :func:`attention_path` finds for this model and these options.
    """
    from branchgym.agents.forward.packed import FORWARD_TOKENS

    shape = model_shape(args.model, lora_rank=args.lora_rank, lora_targets=args.lora_targets)
    if device is None:
        device = "cuda" if args.device in ("auto", "cuda") else "cpu"
    tokens = args.micro_batch_tokens or FORWARD_TOKENS
    from branchgym.agents.training.policy_kinds import resolve_policy

    scoring = resolve_policy(args.policy, args.model) == "scoring"
    masked = bool(args.pack_trees or scoring)
    plan = estimate(
        shape,
        precision=args.precision,
        lora=bool(args.lora_rank),
        gradient_checkpointing=args.gradient_checkpointing,
        tokens=tokens,
        masked=masked,
        reference=reference,
        device=device,
        path=attention_path(args.model, args.gradient_checkpointing) if masked else None,
    )
    teacher = getattr(args, "teacher", None)
    if teacher:  # OPD's frozen teacher, loaded in float32 (Run.load_frozen)
        t = model_shape(teacher)
        plan.parts.insert(1, ("teacher", t.params * 4, f"{t.params / 1e9:.2f} B x 4 B, frozen"))
    return plan


def measure_peak(fn: Callable[[], Any], *track: Any) -> dict[str, int]:
    """Run ``fn`` and return its peak bytes by kind (``Total``, ``Activation``, ...).

    ``track``: modules and optimizers allocated before ``fn`` (their parameters, gradients
    and state count towards the peak). Uses torch's ``MemTracker`` (torch's allocation
    tracking through tensor subclass dispatch; it works on CPU, where the allocator has
    no statistics of its own).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*track)
    with tracker:
        fn()
    snap = tracker.get_tracker_snapshot("peak")
    out: dict[str, int] = {}
    for per_device in snap.values():
        for kind, value in per_device.items():
            key = getattr(kind, "value", str(kind))
            out[key] = out.get(key, 0) + int(value)
    return out


# ------------------------------------------------------------------ training pieces


class MasterWeights:
    """bfloat16 parameters trained through float32 masters (``precision=bf16``).

    The optimizer sees :attr:`params` (float32 copies); after backward,
    :meth:`grads_to_masters` moves each bf16 gradient onto its master as float32, and
    after ``optimizer.step()`` :meth:`masters_to_params` rounds the masters back into the
    model. Small updates accumulate in float32 instead of vanishing in bf16 rounding.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Float32 masters of the bfloat16 ones among ``params`` (others train as they are)."""
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self.params: list[torch.nn.Parameter] = []
        for p in params:
            if p.dtype == torch.float32:
                self.params.append(p)
                continue
            m = torch.nn.Parameter(p.detach().float().clone())
            self.pairs.append((p, m))
            self.params.append(m)

    def grads_to_masters(self) -> None:
        """Each model gradient, as float32, onto its master (the bf16 one is freed)."""
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """Round the updated masters into the model's parameters."""
        for p, m in self.pairs:
            p.copy_(m)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The masters, by position (saved with the checkpoint: bf16 weights lose them)."""
        return {f"master.{i}": m.detach().cpu() for i, (_, m) in enumerate(self.pairs)}

    @torch.no_grad()
    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the masters and round them into the model."""
        if len(tensors) != len(self.pairs):
            raise DataError(
                f"the checkpoint holds {len(tensors)} master weights, this model trains "
                f"{len(self.pairs)}; resume with the options it was saved with."
            )
        for i, (p, m) in enumerate(self.pairs):
            m.copy_(tensors[f"master.{i}"])
            p.copy_(m)


@contextlib.contextmanager
def training_mode(model: Any, enabled: bool = True) -> Iterator[None]:
    """Train mode for the training forward (gradient checkpointing applies only then).

    Dropout stays off, so the scored policy is the one that sampled; the previous mode
    comes back afterwards (the engine samples in eval mode).
    """
    if not enabled:
        yield
        return
    was = model.training
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.eval()
    try:
        yield
    finally:
        model.train(was)


def token_chunks(
    costs: Sequence[int], groups: Sequence[Any], budget: int, *, whole_groups: bool = False
) -> list[list[int]]:
    """Positions of ``costs`` in consecutive chunks of at most ``budget`` tokens.

    A chunk closes before the item that would take it over the budget (an item larger
    than the budget goes alone). With ``whole_groups`` it closes only where the group
    changes, so no group is split (a chunk may then exceed the budget by one group).
    """
    if budget < 1:
        raise TrainingConfigError(f"micro_batch_tokens must be >= 1; got {budget}.")
    out: list[list[int]] = []
    used = 0
    for i, (cost, group) in enumerate(zip(costs, groups, strict=True)):
        if not out:
            out.append([])
        elif used + cost > budget and (not whole_groups or groups[out[-1][-1]] != group):
            out.append([])
            used = 0
        out[-1].append(i)
        used += cost
    return out
