import pytest

from romans import to_roman


def test_additive():
    assert [to_roman(n) for n in (1, 3, 8, 2023)] == ["I", "III", "VIII", "MMXXIII"]


def test_range():
    with pytest.raises(ValueError):
        to_roman(0)


def test_subtractive_small():
    assert [to_roman(n) for n in (4, 9, 14)] == ["IV", "IX", "XIV"]


def test_subtractive_large():
    assert [to_roman(n) for n in (40, 90, 400)] == ["XL", "XC", "CD"]
    assert to_roman(1994) == "MCMXCIV"
