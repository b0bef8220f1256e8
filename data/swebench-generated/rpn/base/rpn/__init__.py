from rpn.core import evaluate
