from semver import compare, latest


def test_equal():
    assert compare("1.2.3", "1.2.3") == 0


def test_simple_order():
    assert compare("1.2.3", "1.2.4") == -1
    assert latest(["0.1.0", "0.3.0", "0.2.0"]) == "0.3.0"
