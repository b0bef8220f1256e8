from intervals import merge


def test_overlapping():
    assert merge([(5, 8), (1, 4), (2, 6)]) == [(1, 8)]


def test_contained():
    assert merge([(1, 10), (2, 3)]) == [(1, 10)]
