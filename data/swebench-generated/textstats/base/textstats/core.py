"""Small text statistics."""


def words(text):
    """The words of ``text``."""
    return [w for w in text.split(" ")]


def word_count(text):
    """How many words ``text`` has."""
    return len(words(text))


def longest_word(text):
    """The longest word (the first one on ties)."""
    ws = words(text)
    return max(ws, key=len) if ws else ""
