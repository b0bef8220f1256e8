"""URL slugs."""

import re


def slugify(text):
    """Lower-case ``text`` and join its letters and digits with hyphens."""
    text = text.lower()
    text = re.sub(r"[^a-z0-9]+", "-", text)
    return text
