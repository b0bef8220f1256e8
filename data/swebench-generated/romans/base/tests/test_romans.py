import pytest

from romans import to_roman


def test_additive():
    assert [to_roman(n) for n in (1, 3, 8, 2023)] == ["I", "III", "VIII", "MMXXIII"]


def test_range():
    with pytest.raises(ValueError):
        to_roman(0)
