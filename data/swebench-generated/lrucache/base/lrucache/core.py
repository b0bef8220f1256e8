"""A least-recently-used cache."""

from collections import OrderedDict


class LRUCache:
    """Keeps the ``capacity`` most recently used entries."""

    def __init__(self, capacity):
        self.capacity = capacity
        self._data = OrderedDict()

    def get(self, key, default=None):
        """The value of ``key``, or ``default``."""
        return self._data.get(key, default)

    def put(self, key, value):
        """Insert or replace ``key``; evicts the least recently used entry."""
        if key in self._data:
            self._data.move_to_end(key)
        self._data[key] = value
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)

    def __len__(self):
        return len(self._data)
