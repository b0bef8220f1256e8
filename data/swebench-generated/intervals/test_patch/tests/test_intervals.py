from intervals import merge


def test_overlapping():
    assert merge([(5, 8), (1, 4), (2, 6)]) == [(1, 8)]


def test_contained():
    assert merge([(1, 10), (2, 3)]) == [(1, 10)]


def test_touching_intervals_merge():
    assert merge([(3, 5), (1, 3)]) == [(1, 5)]


def test_float_gap_kept():
    assert merge([(1.0, 2.0), (2.5, 3.0)]) == [(1.0, 2.0), (2.5, 3.0)]
