from lrucache import LRUCache


def test_capacity():
    c = LRUCache(2)
    for k in "abc":
        c.put(k, k)
    assert len(c) == 2 and c.get("a") is None


def test_get_missing_returns_default():
    assert LRUCache(1).get("x", 7) == 7


def test_get_refreshes_recency():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1
    c.put("c", 3)
    assert c.get("a") == 1 and c.get("b") is None
