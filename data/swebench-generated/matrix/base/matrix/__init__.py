from matrix.core import identity, transpose
