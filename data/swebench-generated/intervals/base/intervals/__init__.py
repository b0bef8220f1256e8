from intervals.core import merge
