"""Dotted version numbers."""


def parse(version):
    """The components of ``version``."""
    return tuple(version.split("."))


def compare(a, b):
    """-1, 0 or 1 as version ``a`` is older than, equal to or newer than ``b``."""
    pa, pb = parse(a), parse(b)
    return (pa > pb) - (pa < pb)


def latest(versions):
    """The newest of ``versions``."""
    return max(versions, key=parse)
