"""Reverse Polish notation."""

import operator

_OPS = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
}


def evaluate(expr):
    """The value of the RPN expression ``expr``."""
    stack = []
    for tok in expr.split():
        if tok in _OPS:
            a = stack.pop()
            b = stack.pop()
            stack.append(_OPS[tok](a, b))
        else:
            stack.append(float(tok))
    if len(stack) != 1:
        raise ValueError(f"malformed expression: {expr!r}")
    return stack[0]
