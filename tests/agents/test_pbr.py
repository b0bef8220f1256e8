"""PBR detectors (branchgym.agents.estimators.pbr) and their use with pbr_loss."""

import pytest
import torch

from branchgym.agents.estimators import losses as L
from branchgym.agents.estimators import pbr
from branchgym.error import LossInputError

EOS, THINK_CLOSE = 0, 9


def seq_of(pieces, ids=None, spans=None):
    ids = ids if ids is not None else [100 + i for i in range(len(pieces))]
    return pbr.ProtocolSequence(ids, pieces, spans)


def test_final_answer_eos_points_at_the_last_answer_token():
    pieces = ["Q: 6*7?", " So", " \\boxed{", "4", "2", "}", ".", " Also", " \\boxed{1}"]
    seq = seq_of(pieces, spans=[(1, len(pieces))])
    (c,) = pbr.FinalAnswerEOS((EOS,))(seq)
    assert (c.position, c.token_ids, c.target, c.rule) == (5, (EOS,), 1.0, "final_answer_eos")
    # nested braces and an unfinished box
    assert pbr.boxed_answer_end("x \\boxed{\\frac{1}{2}} y") == len("x \\boxed{\\frac{1}{2}}")
    assert pbr.boxed_answer_end("x \\boxed{\\frac{1}{2} y") is None
    assert pbr.boxed_answer_end("no answer") is None
    # the prompt's own box (outside the reply span) does not count
    prompt_box = seq_of(["\\boxed{3}", " hmm"], spans=[(1, 2)])
    assert pbr.FinalAnswerEOS((EOS,))(prompt_box) == []


def test_final_answer_eos_only_violations_and_tags():
    stopped = seq_of(["<answer>", "B07", "</answer>", "<eos>"], ids=[1, 2, 3, EOS])
    ran_on = seq_of(["<answer>", "B07", "</answer>", " and"], ids=[1, 2, 3, 4])
    rule = pbr.FinalAnswerEOS((EOS,), answer_end=pbr.tag_answer_end("</answer>"))
    assert [c.position for c in rule(stopped)] == [2]
    strict = pbr.FinalAnswerEOS((EOS,), pbr.tag_answer_end("</answer>"), only_violations=True)
    assert strict(stopped) == [] and [c.position for c in strict(ran_on)] == [2]
    with pytest.raises(LossInputError, match="eos_token_ids"):
        pbr.FinalAnswerEOS(())(stopped)


def test_stray_think_close_at_reply_start():
    prompt = ["<think>", "\n\n", "</think>", "\n\n", "Task:", " go"]  # no-thinking template
    reply = ["</think>", "\n", "</think>", "go", " north", "</think>"]
    ids = list(range(20, 26)) + [THINK_CLOSE, 30, THINK_CLOSE, 31, 32, THINK_CLOSE]
    seq = seq_of(prompt + reply, ids=ids, spans=[(6, 12)])
    cons = pbr.StrayThinkClose(token_ids=(THINK_CLOSE,))(seq)
    # both tags of the leading run, each at the position that predicted it; not the late one
    assert [(c.position, c.token_ids, c.target) for c in cons] == [
        (5, (THINK_CLOSE,), 0.0),
        (7, (THINK_CLOSE,), 0.0),
    ]
    # without explicit ids, C is the observed token
    assert [c.token_ids for c in pbr.StrayThinkClose()(seq)] == [(THINK_CLOSE,)] * 2
    # a prompt that leaves the think block open makes the closing tag legitimate
    open_prompt = seq_of(["<think>", "\n", "</think>", "ok"], spans=[(2, 4)])
    assert pbr.StrayThinkClose()(open_prompt) == []
    assert len(pbr.StrayThinkClose(open_tag=None)(open_prompt)) == 1
    # a reply that starts the whole sequence has no predicting position
    assert pbr.StrayThinkClose()(seq_of(["</think>", "hi"])) == []


def test_detect_fills_rows_and_checks_detectors():
    a = seq_of(["</think>", "x"], spans=[(1, 2)])
    b = seq_of(["p", "</think>", "\\boxed{1}", "more"], spans=[(1, 4)])
    rules = [pbr.StrayThinkClose(), pbr.FinalAnswerEOS((EOS,))]
    assert all(isinstance(r, pbr.Detector) for r in rules)
    assert set(pbr.DETECTORS) == {"final_answer_eos", "stray_think_close"}
    cons = pbr.detect([a, b], rules)
    assert [(c.seq, c.rule, c.position) for c in cons] == [
        (1, "stray_think_close", 0),
        (1, "final_answer_eos", 2),
    ]
    with pytest.raises(LossInputError, match="not a detector"):
        pbr.detect([a], ["stray_think_close"])


def test_sequence_validation_and_tokenizer_pieces():
    with pytest.raises(LossInputError, match="pieces"):
        pbr.ProtocolSequence([1, 2], ["a"])
    with pytest.raises(LossInputError, match="outside"):
        pbr.ProtocolSequence([1, 2], ["a", "b"], [(1, 3)])

    class Tok:
        def decode(self, ids):
            return {5: "</think>", 6: "hi"}[ids[0]]

    seq = pbr.ProtocolSequence.from_tokenizer(Tok(), [6, 5, 6], [(1, 3)])
    assert seq.pieces == ["hi", "</think>", "hi"]


def test_detectors_and_pbr_loss_repair_a_tiny_model():
    """End to end: a few descent steps on PBR alone raise EOS and suppress the stray tag."""
    torch.manual_seed(0)
    vocab = 12
    pieces = ["p", "</think>", "\\boxed{", "7", "}", " and", " on"]
    ids = [1, THINK_CLOSE, 2, 3, 4, 5, 6]
    seqs = [seq_of(pieces, ids=ids, spans=[(1, 7)])]
    cons = pbr.detect(seqs, [pbr.StrayThinkClose(), pbr.FinalAnswerEOS((EOS,))])
    assert [(c.position, c.target) for c in cons] == [(0, 0.0), (4, 1.0)]
    logits = torch.randn(1, len(ids), vocab, requires_grad=True)
    lr = 500.0  # lambda = 0.01 makes the loss small

    def probs():
        p = torch.softmax(logits.detach(), -1)[0]
        return float(p[0, THINK_CLOSE]), float(p[4, EOS])

    stray0, eos0 = probs()
    for _ in range(20):
        (grad,) = torch.autograd.grad(L.pbr_loss(logits, cons).loss, logits)
        with torch.no_grad():
            logits -= lr * grad
    stray1, eos1 = probs()
    assert stray1 < stray0 / 2 and eos1 > 2 * eos0
