"""onednn_linear: the engine's float32 linear layers on oneDNN, same numbers, scoped, undone."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from branchgym.agents.engines.hf import HFEngine  # noqa: E402
from branchgym.agents.engines.linear import onednn_available, onednn_linear  # noqa: E402
from branchgym.agents.policies.models import tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN")

OP = "mkldnn::_linear_pointwise"


@pytest.fixture(scope="module")
def tiny():
    return tiny_qwen2()


def token_ids(model, shape, seed):
    """Random token ids of ``shape`` for ``model``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, shape, generator=gen)


def ops_run(fn):
    """``fn()``'s result and the names of the ATen ops it ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events()}


def test_a_forward_runs_on_onednn_with_the_same_logits_and_is_undone(tiny):
    model, _ = tiny
    ids = token_ids(model, (3, 17), 0)
    with torch.inference_mode():
        plain, names = ops_run(lambda: model(input_ids=ids).logits)
        assert OP not in names
        with onednn_linear(model):
            fast, names = ops_run(lambda: model(input_ids=ids).logits)
        assert OP in names
        after, names = ops_run(lambda: model(input_ids=ids).logits)
    assert OP not in names  # every layer has its class's forward back
    assert all("forward" not in vars(m) for m in model.modules())
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(after, plain)


def test_autograd_disabled_flags_nesting_and_errors(tiny):
    model, _ = tiny
    ids = token_ids(model, (2, 9), 1)
    with onednn_linear(model):  # training inside: the op has no backward, F.linear runs
        loss, names = ops_run(lambda: model(input_ids=ids).logits.logsumexp(-1).mean())
        loss.backward()
    assert OP not in names
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    model.zero_grad(set_to_none=True)
    with torch.no_grad(), onednn_linear(model, enabled=False):
        _, names = ops_run(lambda: model(input_ids=ids))
    assert OP not in names
    with pytest.raises(RuntimeError, match="boom"), onednn_linear(model):
        with onednn_linear(model):  # nested: the outer block's layers stay patched
            pass
        with torch.no_grad():
            _, names = ops_run(lambda: model(input_ids=ids))
        assert OP in names
        raise RuntimeError("boom")
    assert all("forward" not in vars(m) for m in model.modules())
    with torch.no_grad():
        _, names = ops_run(lambda: model(input_ids=ids))
    assert OP not in names


def test_the_engine_samples_the_same_tokens_either_way(tiny):
    model, tok = tiny
    prompts = [tok.encode(f"<|im_start|>user\nroom {k}: go north<|im_end|>\n") for k in range(3)]
    runs = {}
    for flag in (True, False):
        eng = HFEngine(model, tok, max_new_tokens=10, onednn_linear=flag)
        gens, names = ops_run(lambda eng=eng: eng.generate(prompts, 2, seeds=[5, 6, 7]))
        assert (OP in names) is flag
        runs[flag] = gens
    for mine, theirs in zip(runs[True], runs[False], strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
            np.testing.assert_allclose(a.entropies, b.entropies, atol=1e-4)
