from csvline import split_row


def test_plain():
    assert split_row("a, b ,c") == ["a", "b", "c"]


def test_other_separator():
    assert split_row("x;y", sep=";") == ["x", "y"]
