"""Float32 linear layers through oneDNN on a CPU, for the engine's inference passes.

PyTorch's CPU build sends a float32 ``nn.Linear`` to MKL. On an AMD CPU MKL takes its
AVX2 code path even where the CPU has AVX-512 (this machine: AMD EPYC, family 26, with
AVX-512 and 2 cores), while oneDNN, which PyTorch also ships, picks its kernels by the
CPU's instruction sets. The same float32 products, timed one after the other on this
machine (``branchgym bench linear`` prints them anywhere):

==========================  ==========  ==========
rows x (in -> out)          MKL         oneDNN
==========================  ==========  ==========
16 x (576 -> 1536)          0.249 ms    0.112 ms
1,036 x (576 -> 1536)       8.72 ms     3.96 ms
16 x (576 -> 49,152)        11.4 ms     5.08 ms
1 x (576 -> 49,152)         6.97 ms     2.82 ms
==========================  ==========  ==========

SmolLM2-135M's layers have these shapes: a decoded token of sixteen rows, a prefill pass
of a thousand tokens, the output layer. Both libraries compute in IEEE float32 and differ
in summation order only (against a float64 reference, the largest error of a 1,536-term
product: 3.1e-6 MKL, 1.2e-5 oneDNN, on outputs of about 2).

:func:`onednn_linear` runs a model with its plain ``nn.Linear`` layers on
``torch.ops.mkldnn._linear_pointwise`` (the op PyTorch's own compiler uses for CPU
linear layers). The op has no backward, so a layer falls back to ``F.linear`` whenever
autograd is recording, and for any dtype but float32. Subclasses of ``nn.Linear``
(quantised or adapter layers) keep their own forward.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["onednn_applies", "onednn_available", "onednn_linear"]

#: Set on a model while :func:`onednn_linear` runs it (nested entries do nothing).
_MARK = "_branchgym_onednn_linear"


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's CPU linear op."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available()) and hasattr(ops, "_linear_pointwise")


def onednn_applies(model: Any, enabled: bool = True) -> bool:
    """Whether :func:`onednn_linear` would move ``model``'s float32 layers to oneDNN.

    True for an enabled ``nn.Module`` on a CPU with a PyTorch build that has the op.
    """
    device = getattr(model, "device", torch.device("cpu"))
    return (
        enabled
        and isinstance(model, torch.nn.Module)
        and torch.device(device).type == "cpu"
        and onednn_available()
    )


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through oneDNN when nothing needs a gradient."""
    w = self.weight
    if (
        x.dtype != torch.float32
        or w.dtype != torch.float32
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    ):
        return torch.nn.functional.linear(x, w, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")


@contextlib.contextmanager
def onednn_linear(model: Any, enabled: bool = True) -> Iterator[None]:
    """Run ``model``'s float32 ``nn.Linear`` layers on oneDNN inside the block (CPU).

    Nothing changes when ``enabled`` is false, when the build lacks oneDNN, on another
    device, or inside an outer ``onednn_linear`` of the same model. The layers get their
    own forward back on exit, also after an error.
    """
    if getattr(model, _MARK, False) or not onednn_applies(model, enabled):
        yield
        return
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for layer in layers:
        layer.forward = types.MethodType(_forward, layer)
    setattr(model, _MARK, True)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again
        setattr(model, _MARK, False)
