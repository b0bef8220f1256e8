import pytest

from rpn import evaluate


def test_addition():
    assert evaluate("2 3 +") == 5.0


def test_product_of_sum():
    assert evaluate("2 3 + 4 *") == 20.0


def test_malformed():
    with pytest.raises(ValueError):
        evaluate("1 2")


def test_subtraction_order():
    assert evaluate("5 3 -") == 2.0


def test_division_order():
    assert evaluate("8 2 /") == 4.0
