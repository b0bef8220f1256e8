from lrucache.core import LRUCache
