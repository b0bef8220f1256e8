import pytest

from durations import parse_duration


def test_hours_minutes():
    assert parse_duration("1h30m") == 5400


def test_unknown_unit():
    with pytest.raises(ValueError):
        parse_duration("5x")


def test_seconds():
    assert parse_duration("90s") == 90


def test_days():
    assert parse_duration("1d2h30m15s") == 95415
