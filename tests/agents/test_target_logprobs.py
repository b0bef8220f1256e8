"""Chunked target log-probs through the output layer equal the plain log-softmax, gradients too."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from branchgym.agents.forward import packed as fwd  # noqa: E402
from branchgym.agents.forward import target_logprobs as tl  # noqa: E402
from branchgym.agents.forward.packed import Pack, packed_forward  # noqa: E402
from branchgym.agents.policies.models import tiny_qwen2  # noqa: E402


def plain(hidden, head, targets):
    return torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[:, None])[:, 0]


@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_equal_the_plain_log_softmax(bias):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(24, 500, bias=bias)
    rows = 2 * tl.CHUNK_ROWS + 37  # three chunks, the last one partial
    hidden = torch.randn(rows, 24, generator=g, requires_grad=True)
    targets = torch.randint(0, 500, (rows,), generator=g)
    weights = torch.randn(rows, generator=g)

    def grads(fn):
        hidden.grad = None
        head.zero_grad(set_to_none=True)
        out = fn(hidden, head, targets)
        (out * weights).sum().backward()
        return out.detach(), [hidden.grad] + [p.grad for p in head.parameters()]

    got, got_g = grads(tl.target_logprobs)
    want, want_g = grads(plain)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(got_g) == (3 if bias else 2)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the reference pass: nothing kept for a backward pass
        torch.testing.assert_close(tl.target_logprobs(hidden, head, targets), want)


def test_only_a_plain_linear_head_is_fused():
    assert tl.fusable(torch.nn.Linear(4, 8))
    assert not tl.fusable(torch.nn.Sequential(torch.nn.Linear(4, 8)))
    assert not tl.fusable(None)


def test_packed_forward_scores_equal_the_unfused_head(monkeypatch):
    model, _ = tiny_qwen2()
    packs = [
        Pack(list(range(5, 25)), [(12, 20, 6)], [(i, 7 + i) for i in range(2, 19)]),
        Pack(list(range(30, 41)), [], [(i, 3 * i) for i in range(0, 10)]),
    ]
    where = [[3, 15], [4]]

    def run():
        model.zero_grad(set_to_none=True)
        lps, rows = packed_forward(model, packs, torch.device("cpu"), logit_positions=where)
        (torch.cat(lps).sum() + sum(r.sum() for r in rows) * 1e-3).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return [x.detach() for x in lps], [r.detach() for r in rows], grads

    fused = run()
    monkeypatch.setattr(fwd, "fusable", lambda head: False)
    unfused = run()
    for a, b in zip(fused, unfused, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)
