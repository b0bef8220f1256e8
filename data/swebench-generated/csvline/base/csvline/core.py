"""One line of CSV."""


def split_row(line, sep=","):
    """The stripped fields of ``line``."""
    return [field.strip() for field in line.split(sep)]
