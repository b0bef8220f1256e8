from textwrap2 import wrap


def test_short_text():
    assert wrap("hello", 10) == ["hello"]


def test_long_word_kept_whole():
    assert wrap("extraordinary", 5) == ["extraordinary"]


def test_exact_fit():
    assert wrap("aaa bb", 6) == ["aaa bb"]


def test_width_respected():
    lines = wrap("aaa bbb ccc dd e", 6)
    assert lines == ["aaa", "bbb", "ccc dd", "e"]
    assert all(len(line) <= 6 for line in lines)
