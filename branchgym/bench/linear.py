"""``branchgym bench linear``: a float32 linear layer on MKL (PyTorch's default) and oneDNN.

:class:`~branchgym.agents.engines.hf.HFEngine` runs its float32 linear layers on a CPU
through oneDNN (:mod:`branchgym.agents.engines.linear`) because, on an AMD CPU, MKL takes
its AVX2 path where oneDNN uses AVX-512. Whether that holds on another machine is what
this study prints: for each shape (rows x in -> out; SmolLM2-135M's by default: a decoded
token of 1 and 16 rows, a prefill pass of 1,036 tokens; the attention, MLP and output
layers), the median time of each library over the same inputs, timed in alternation
over ``--weights`` distinct weight matrices (so they are read from memory as a model's
are, not from cache), their ratio, and each one's largest error against a float64
product. This study measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse

from branchgym.bench.common import Report, positive_int, time_calls

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``branchgym bench linear``."""
    parser.add_argument("--hidden", type=positive_int, default=576, help="model width (576)")
    parser.add_argument("--intermediate", type=positive_int, default=1536, help="MLP width (1536)")
    parser.add_argument("--vocab", type=positive_int, default=49152, help="output rows (49152)")
    parser.add_argument(
        "--rows", type=positive_int, nargs="+", default=[1, 16, 1036],
        help="input rows per call (1 16 1036)",
    )  # fmt: skip
    parser.add_argument(
        "--weights", type=positive_int, default=8, help="distinct weight matrices per shape (8)"
    )
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed rounds (5)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    parser.add_argument("--out", default="results", help="report folder")


def _time(fn, weights, repeats: int) -> float:
    """Median seconds of one call of ``fn(w)``, over ``repeats`` rounds of every weight."""

    def one_round() -> None:  # returns nothing: time_calls keeps each call's result
        for w in weights:
            fn(w)

    timing, _ = time_calls(one_round, repeats)
    return timing.median_ms / 1e3 / len(weights)


def main(args: argparse.Namespace) -> int:
    """Time both libraries on each shape and write ``linear.md``."""
    import torch

    from branchgym.agents.engines.linear import onednn_available

    if args.threads:
        torch.set_num_threads(args.threads)
    if not onednn_available():
        print("this PyTorch build has no oneDNN linear op: nothing to compare")
        return 1
    op = torch.ops.mkldnn._linear_pointwise
    layers = [
        ("q, o projection", args.hidden, args.hidden),
        ("MLP up", args.hidden, args.intermediate),
        ("MLP down", args.intermediate, args.hidden),
        ("output layer", args.hidden, args.vocab),
    ]
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for rows in args.rows:
        for name, k, n in layers:
            x = torch.randn(rows, k, generator=gen)
            weights = [torch.randn(n, k, generator=gen) / k**0.5 for _ in range(args.weights)]
            big = n * k > 4_000_000  # the output layer: fewer rounds
            reps = max(1, args.repeats // 2) if big else args.repeats
            mkl = _time(lambda w, x=x: torch.nn.functional.linear(x, w), weights, reps)
            dnn = _time(lambda w, x=x: op(x, w, None, "none", [], ""), weights, reps)
            exact = torch.nn.functional.linear(x.double(), weights[0].double())
            err_mkl = (torch.nn.functional.linear(x, weights[0]).double() - exact).abs().max()
            err_dnn = (op(x, weights[0], None, "none", [], "").double() - exact).abs().max()
            rows_out.append([rows, name, f"{k} -> {n}", f"{mkl * 1e3:.3f}", f"{dnn * 1e3:.3f}",
                             f"{mkl / dnn:.2f}x", f"{float(err_mkl):.1e}",
                             f"{float(err_dnn):.1e}"])  # fmt: skip
    report = Report(args.out, "linear", "branchgym bench linear")
    report.add(
        f"float32, {torch.get_num_threads()} threads, {args.weights} weight matrices per "
        f"shape, median of {args.repeats} rounds; errors: largest |y - y64| of one product."
    )
    print(report.table(["rows", "layer", "in -> out", "MKL ms", "oneDNN ms", "MKL / oneDNN",
                        "MKL error", "oneDNN error"], rows_out))  # fmt: skip
    report.data = {"args": vars(args), "rows": rows_out}
    print(f"report: {report.save()}")
    return 0
