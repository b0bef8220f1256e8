from romans.core import to_roman
