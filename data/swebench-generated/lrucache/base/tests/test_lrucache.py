from lrucache import LRUCache


def test_capacity():
    c = LRUCache(2)
    for k in "abc":
        c.put(k, k)
    assert len(c) == 2 and c.get("a") is None


def test_get_missing_returns_default():
    assert LRUCache(1).get("x", 7) == 7
