"""Lists-of-lists matrices."""


def identity(n):
    """The n x n identity matrix."""
    return [[int(i == j) for j in range(n)] for i in range(n)]


def transpose(m):
    """The transpose of ``m``."""
    return [[m[j][i] for j in range(len(m))] for i in range(len(m))]
