"""The generated task set: twelve tiny Python repositories, each with one real bug.

Every task is a real git repository built on first use (in the branchgym cache, a few
hundred milliseconds in all) with an issue text, a gold patch, a test patch, and the
FAIL_TO_PASS / PASS_TO_PASS lists, in SWE-bench's exact record format. So the whole
loop (edit, test, submit, grade) runs offline, in tests and demos. Each task also ships
a plausible *wrong* fix (it passes some new tests but not all, or breaks an old one),
so graders are tested against near misses as well as against an empty patch, and a
one-line ``fix_command`` that applies the gold fix from a shell, for scripted agents.

The sources below are the data; :func:`build_generated_tasks` turns them into repos
with deterministic commits (fixed author and dates), so ``base_commit`` is the same on
every machine.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import textwrap
from pathlib import Path

from branchgym.envs.swebench.tasks import DEFAULT_TEST_CMD, SWEBenchTask, cache_root, load_tasks
from branchgym.error import DataError

__all__ = ["TaskDef", "TASK_DEFS", "build_generated_tasks", "generated_tasks", "generated_repos"]

#: Bump when the build procedure changes (the cache key includes it).
FORMAT_VERSION = 3

_GITIGNORE = "__pycache__/\n*.pyc\n.pytest_cache/\n"


@dataclasses.dataclass(frozen=True)
class TaskDef:
    """The source of one generated task.

    Attributes:
        name: Package name; the repository is ``branchgym/<name>``.
        issue: The problem statement.
        files: Repository files at the base commit.
        fix: ``(path, old, new)`` replacements that make the gold patch.
        wrong: Replacements of a plausible but wrong fix.
        tests: New content of test files (the test patch).
        fail_to_pass: Test ids that fail before the fix and pass after.
        pass_to_pass: Test ids that pass before and after.
    """

    name: str
    issue: str
    files: dict[str, str]
    fix: tuple[tuple[str, str, str], ...]
    wrong: tuple[tuple[str, str, str], ...]
    tests: dict[str, str]
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]

    @property
    def instance_id(self) -> str:
        """``branchgym__<name>-1``, SWE-bench's ``owner__name-number`` form."""
        return f"branchgym__{self.name}-1"

    def fixed_files(self, which: str = "fix") -> dict[str, str]:
        """The files the gold (or ``wrong``) fix produces."""
        out = {}
        for path, old, new in getattr(self, which):
            text = out.get(path, self.files[path])
            if old not in text:
                raise DataError(f"{self.name}: fix text not found in {path}: {old!r}")
            out[path] = text.replace(old, new, 1)
        return out

    @property
    def fix_command(self) -> str:
        """One shell line that applies the gold fix (from any working directory)."""
        # One physical line (no newline even inside the quotes), so it can be typed or
        # piped line by line, as `branchgym play` reads its input.
        code = (
            "import pathlib; [pathlib.Path(p).write_text(pathlib.Path(p).read_text()"
            f".replace(a, b, 1)) for p, a, b in {[list(r) for r in self.fix]!r}]"
        )
        return "cd /testbed && python3 -c " + shlex.quote(code)


def _d(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _t(name: str, *tests: str) -> tuple[str, ...]:
    return tuple(f"tests/test_{name}.py::{t}" for t in tests)


# ----------------------------------------------------------------------- the tasks

TASK_DEFS: tuple[TaskDef, ...] = (
    TaskDef(
        name="textstats",
        issue=_d("""
            word_count() miscounts text with repeated spaces or line breaks

            `textstats.word_count("hello  world")` returns 3 instead of 2, and
            `word_count("one\\ntwo")` returns 1: words are split on single spaces only,
            so empty strings between spaces count as words and newlines or tabs do not
            separate words. `word_count("")` returns 1. Words should be separated by any
            run of whitespace.
            """),
        files={
            "textstats/__init__.py": "from textstats.core import longest_word, word_count, words\n",
            "textstats/core.py": _d('''
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
                '''),
            "tests/test_textstats.py": _d("""
                from textstats import longest_word, word_count


                def test_simple_count():
                    assert word_count("the quick brown fox") == 4


                def test_longest_word():
                    assert longest_word("a bb ccc dd") == "ccc"
                """),
        },
        fix=(("textstats/core.py", 'return [w for w in text.split(" ")]', "return text.split()"),),
        wrong=(
            (
                "textstats/core.py",
                'return [w for w in text.split(" ")]',
                'return [w for w in text.split(" ") if w]',
            ),
        ),
        tests={
            "tests/test_textstats.py": _d("""
                from textstats import longest_word, word_count


                def test_simple_count():
                    assert word_count("the quick brown fox") == 4


                def test_longest_word():
                    assert longest_word("a bb ccc dd") == "ccc"


                def test_repeated_spaces():
                    assert word_count("hello  world") == 2


                def test_newlines_and_tabs():
                    assert word_count("one\\ntwo\\tthree") == 3


                def test_empty_text():
                    assert word_count("") == 0
                """),
        },
        fail_to_pass=_t(
            "textstats", "test_repeated_spaces", "test_newlines_and_tabs", "test_empty_text"
        ),
        pass_to_pass=_t("textstats", "test_simple_count", "test_longest_word"),
    ),
    TaskDef(
        name="intervals",
        issue=_d("""
            merge() leaves touching intervals apart

            `intervals.merge([(1, 3), (3, 5)])` returns `[(1, 3), (3, 5)]`, but intervals
            that share an end point overlap (they are closed) and should be merged into
            `[(1, 5)]`.
            """),
        files={
            "intervals/__init__.py": "from intervals.core import merge\n",
            "intervals/core.py": _d('''
                """Closed intervals."""


                def merge(intervals):
                    """Merge overlapping closed intervals; returns a sorted list."""
                    result = []
                    for start, end in sorted(intervals):
                        if result and start < result[-1][1]:
                            result[-1] = (result[-1][0], max(result[-1][1], end))
                        else:
                            result.append((start, end))
                    return result
                '''),
            "tests/test_intervals.py": _d("""
                from intervals import merge


                def test_overlapping():
                    assert merge([(5, 8), (1, 4), (2, 6)]) == [(1, 8)]


                def test_contained():
                    assert merge([(1, 10), (2, 3)]) == [(1, 10)]
                """),
        },
        fix=(("intervals/core.py", "start < result[-1][1]", "start <= result[-1][1]"),),
        wrong=(("intervals/core.py", "start < result[-1][1]", "start - 1 < result[-1][1]"),),
        tests={
            "tests/test_intervals.py": _d("""
                from intervals import merge


                def test_overlapping():
                    assert merge([(5, 8), (1, 4), (2, 6)]) == [(1, 8)]


                def test_contained():
                    assert merge([(1, 10), (2, 3)]) == [(1, 10)]


                def test_touching_intervals_merge():
                    assert merge([(3, 5), (1, 3)]) == [(1, 5)]


                def test_float_gap_kept():
                    assert merge([(1.0, 2.0), (2.5, 3.0)]) == [(1.0, 2.0), (2.5, 3.0)]
                """),
        },
        fail_to_pass=_t("intervals", "test_touching_intervals_merge"),
        pass_to_pass=_t("intervals", "test_overlapping", "test_contained", "test_float_gap_kept"),
    ),
    TaskDef(
        name="romans",
        issue=_d("""
            to_roman() writes 4 as IIII

            `romans.to_roman(4)` returns "IIII" and `to_roman(1994)` returns
            "MDCCCCLXXXXIIII". Standard numerals use subtractive pairs: 4 is "IV",
            9 "IX", 40 "XL", 90 "XC", 400 "CD", 900 "CM" (1994 is "MCMXCIV").
            """),
        files={
            "romans/__init__.py": "from romans.core import to_roman\n",
            "romans/core.py": _d('''
                """Roman numerals."""

                _NUMERALS = [
                    (1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I"),
                ]


                def to_roman(n):
                    """``n`` (1..3999) as a Roman numeral."""
                    if not 0 < n < 4000:
                        raise ValueError(f"{n} is out of range 1..3999")
                    out = []
                    for value, symbol in _NUMERALS:
                        while n >= value:
                            out.append(symbol)
                            n -= value
                    return "".join(out)
                '''),
            "tests/test_romans.py": _d("""
                import pytest

                from romans import to_roman


                def test_additive():
                    assert [to_roman(n) for n in (1, 3, 8, 2023)] == ["I", "III", "VIII", "MMXXIII"]


                def test_range():
                    with pytest.raises(ValueError):
                        to_roman(0)
                """),
        },
        fix=(
            (
                "romans/core.py",
                '(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I"),',
                '(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),\n'
                '    (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),',
            ),
        ),
        wrong=(
            (
                "romans/core.py",
                '(10, "X"), (5, "V"), (1, "I"),',
                '(10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),',
            ),
        ),
        tests={
            "tests/test_romans.py": _d("""
                import pytest

                from romans import to_roman


                def test_additive():
                    assert [to_roman(n) for n in (1, 3, 8, 2023)] == ["I", "III", "VIII", "MMXXIII"]


                def test_range():
                    with pytest.raises(ValueError):
                        to_roman(0)


                def test_subtractive_small():
                    assert [to_roman(n) for n in (4, 9, 14)] == ["IV", "IX", "XIV"]


                def test_subtractive_large():
                    assert [to_roman(n) for n in (40, 90, 400)] == ["XL", "XC", "CD"]
                    assert to_roman(1994) == "MCMXCIV"
                """),
        },
        fail_to_pass=_t("romans", "test_subtractive_small", "test_subtractive_large"),
        pass_to_pass=_t("romans", "test_additive", "test_range"),
    ),
    TaskDef(
        name="slugify",
        issue=_d("""
            slugify() keeps hyphens at the ends

            `slugify("Hello, World!")` gives "hello-world-" and `slugify("  Spaces")`
            gives "-spaces". Slugs should never start or end with a hyphen.
            """),
        files={
            "slugify/__init__.py": "from slugify.core import slugify\n",
            "slugify/core.py": _d('''
                """URL slugs."""

                import re


                def slugify(text):
                    """Lower-case ``text`` and join its letters and digits with hyphens."""
                    text = text.lower()
                    text = re.sub(r"[^a-z0-9]+", "-", text)
                    return text
                '''),
            "tests/test_slugify.py": _d("""
                from slugify import slugify


                def test_basic():
                    assert slugify("Hello World") == "hello-world"


                def test_digits():
                    assert slugify("Top 10 Tips") == "top-10-tips"
                """),
        },
        fix=(("slugify/core.py", "    return text\n", '    return text.strip("-")\n'),),
        wrong=(("slugify/core.py", "    return text\n", '    return text.rstrip("-")\n'),),
        tests={
            "tests/test_slugify.py": _d("""
                from slugify import slugify


                def test_basic():
                    assert slugify("Hello World") == "hello-world"


                def test_digits():
                    assert slugify("Top 10 Tips") == "top-10-tips"


                def test_no_trailing_hyphen():
                    assert slugify("Hello, World!") == "hello-world"


                def test_no_leading_hyphen():
                    assert slugify("  Spaces") == "spaces"
                """),
        },
        fail_to_pass=_t("slugify", "test_no_trailing_hyphen", "test_no_leading_hyphen"),
        pass_to_pass=_t("slugify", "test_basic", "test_digits"),
    ),
    TaskDef(
        name="matrix",
        issue=_d("""
            transpose() fails on non-square matrices

            `matrix.transpose([[1, 2, 3], [4, 5, 6]])` returns `[[1, 4], [2, 5]]`, losing
            the last column; a 3x2 input raises IndexError. The transpose of an m x n
            matrix is n x m.
            """),
        files={
            "matrix/__init__.py": "from matrix.core import identity, transpose\n",
            "matrix/core.py": _d('''
                """Lists-of-lists matrices."""


                def identity(n):
                    """The n x n identity matrix."""
                    return [[int(i == j) for j in range(n)] for i in range(n)]


                def transpose(m):
                    """The transpose of ``m``."""
                    return [[m[j][i] for j in range(len(m))] for i in range(len(m))]
                '''),
            "tests/test_matrix.py": _d("""
                from matrix import identity, transpose


                def test_square():
                    assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]


                def test_identity():
                    assert transpose(identity(3)) == identity(3)


                def test_empty():
                    assert transpose([]) == []
                """),
        },
        fix=(
            (
                "matrix/core.py",
                "    return [[m[j][i] for j in range(len(m))] for i in range(len(m))]",
                "    if not m:\n        return []\n"
                "    return [[row[i] for row in m] for i in range(len(m[0]))]",
            ),
        ),
        wrong=(
            (
                "matrix/core.py",
                "for j in range(len(m))] for i in range(len(m))]",
                "for j in range(len(m[0]))] for i in range(len(m))] if m else []",
            ),
        ),
        tests={
            "tests/test_matrix.py": _d("""
                from matrix import identity, transpose


                def test_square():
                    assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]


                def test_identity():
                    assert transpose(identity(3)) == identity(3)


                def test_empty():
                    assert transpose([]) == []


                def test_wide():
                    assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]


                def test_tall():
                    assert transpose([[1, 2], [3, 4], [5, 6]]) == [[1, 3, 5], [2, 4, 6]]
                """),
        },
        fail_to_pass=_t("matrix", "test_wide", "test_tall"),
        pass_to_pass=_t("matrix", "test_square", "test_identity", "test_empty"),
    ),
    TaskDef(
        name="semver",
        issue=_d("""
            compare() orders 1.10.0 before 1.9.0

            `semver.compare("1.10.0", "1.9.0")` returns -1. Version components are
            compared as strings, so "10" sorts before "9". Components are numbers.
            """),
        files={
            "semver/__init__.py": "from semver.core import compare, latest, parse\n",
            "semver/core.py": _d('''
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
                '''),
            "tests/test_semver.py": _d("""
                from semver import compare, latest


                def test_equal():
                    assert compare("1.2.3", "1.2.3") == 0


                def test_simple_order():
                    assert compare("1.2.3", "1.2.4") == -1
                    assert latest(["0.1.0", "0.3.0", "0.2.0"]) == "0.3.0"
                """),
        },
        fix=(
            (
                "semver/core.py",
                'return tuple(version.split("."))',
                'return tuple(int(part) for part in version.split("."))',
            ),
        ),
        wrong=(
            (
                "semver/core.py",
                'return tuple(version.split("."))',
                'return (int(version.replace(".", "")),)',
            ),
        ),
        tests={
            "tests/test_semver.py": _d("""
                from semver import compare, latest


                def test_equal():
                    assert compare("1.2.3", "1.2.3") == 0


                def test_simple_order():
                    assert compare("1.2.3", "1.2.4") == -1
                    assert latest(["0.1.0", "0.3.0", "0.2.0"]) == "0.3.0"


                def test_major_dominates():
                    assert compare("2.0.0", "1.10.0") == 1


                def test_numeric_components():
                    assert compare("1.10.0", "1.9.0") == 1
                    assert latest(["1.2.9", "1.2.10"]) == "1.2.10"
                """),
        },
        fail_to_pass=_t("semver", "test_numeric_components"),
        pass_to_pass=_t("semver", "test_equal", "test_simple_order", "test_major_dominates"),
    ),
    TaskDef(
        name="lrucache",
        issue=_d("""
            LRUCache.get() does not refresh an entry

            After `c = LRUCache(2); c.put("a", 1); c.put("b", 2); c.get("a"); c.put("c", 3)`
            the cache has evicted "a", although "b" was the least recently used entry.
            Reading an entry should make it the most recently used one.
            """),
        files={
            "lrucache/__init__.py": "from lrucache.core import LRUCache\n",
            "lrucache/core.py": _d('''
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
                '''),
            "tests/test_lrucache.py": _d("""
                from lrucache import LRUCache


                def test_capacity():
                    c = LRUCache(2)
                    for k in "abc":
                        c.put(k, k)
                    assert len(c) == 2 and c.get("a") is None


                def test_get_missing_returns_default():
                    assert LRUCache(1).get("x", 7) == 7
                """),
        },
        fix=(
            (
                "lrucache/core.py",
                "        return self._data.get(key, default)",
                "        if key not in self._data:\n            return default\n"
                "        self._data.move_to_end(key)\n        return self._data[key]",
            ),
        ),
        wrong=(
            (
                "lrucache/core.py",
                "        return self._data.get(key, default)",
                "        self._data.move_to_end(key)\n        return self._data.get(key, default)",
            ),
        ),
        tests={
            "tests/test_lrucache.py": _d("""
                from lrucache import LRUCache


                def test_capacity():
                    c = LRUCache(2)
                    for k in "abc":
                        c.put(k, k)
                    assert len(c) == 2 and c.get("a") is None


                def test_get_missing_returns_default():
                    assert LRUCache(1).get("x", 7) == 7


                def test_get_refreshes_recency():
                    c = LRUCache(2)
                    c.put("a", 1)
                    c.put("b", 2)
                    assert c.get("a") == 1
                    c.put("c", 3)
                    assert c.get("a") == 1 and c.get("b") is None
                """),
        },
        fail_to_pass=_t("lrucache", "test_get_refreshes_recency"),
        pass_to_pass=_t("lrucache", "test_capacity", "test_get_missing_returns_default"),
    ),
    TaskDef(
        name="csvline",
        issue=_d("""
            split_row() breaks quoted fields

            `csvline.split_row('a,"b,c",d')` returns `['a', '"b', 'c"', 'd']`. A field in
            double quotes may contain the separator, and the quotes are not part of the
            value: the result should be `['a', 'b,c', 'd']`.
            """),
        files={
            "csvline/__init__.py": "from csvline.core import split_row\n",
            "csvline/core.py": _d('''
                """One line of CSV."""


                def split_row(line, sep=","):
                    """The stripped fields of ``line``."""
                    return [field.strip() for field in line.split(sep)]
                '''),
            "tests/test_csvline.py": _d("""
                from csvline import split_row


                def test_plain():
                    assert split_row("a, b ,c") == ["a", "b", "c"]


                def test_other_separator():
                    assert split_row("x;y", sep=";") == ["x", "y"]
                """),
        },
        fix=(
            (
                "csvline/core.py",
                '"""One line of CSV."""\n',
                '"""One line of CSV."""\n\nimport csv\n',
            ),
            (
                "csvline/core.py",
                "    return [field.strip() for field in line.split(sep)]",
                "    reader = csv.reader([line], delimiter=sep, skipinitialspace=True)\n"
                "    return [field.strip() for field in next(reader)]",
            ),
        ),
        wrong=(
            (
                "csvline/core.py",
                "[field.strip() for field",
                "[field.strip().strip('\"') for field",
            ),
        ),
        tests={
            "tests/test_csvline.py": _d("""
                from csvline import split_row


                def test_plain():
                    assert split_row("a, b ,c") == ["a", "b", "c"]


                def test_other_separator():
                    assert split_row("x;y", sep=";") == ["x", "y"]


                def test_quoted_separator():
                    assert split_row('a,"b,c",d') == ["a", "b,c", "d"]


                def test_quotes_removed():
                    assert split_row('"x", y') == ["x", "y"]
                """),
        },
        fail_to_pass=_t("csvline", "test_quoted_separator", "test_quotes_removed"),
        pass_to_pass=_t("csvline", "test_plain", "test_other_separator"),
    ),
    TaskDef(
        name="durations",
        issue=_d("""
            parse_duration() rejects seconds and days

            `durations.parse_duration("90s")` raises `ValueError: unknown unit 's'`, and so
            does "2d". Durations like "1d2h30m15s" should be supported (d = 86400 s,
            h = 3600 s, m = 60 s, s = 1 s).
            """),
        files={
            "durations/__init__.py": "from durations.core import parse_duration\n",
            "durations/core.py": _d('''
                """Durations such as 1h30m."""

                import re

                _UNITS = {"h": 3600, "m": 60}


                def parse_duration(text):
                    """``text`` in seconds."""
                    total = 0
                    for amount, unit in re.findall(r"(\\d+)([a-z])", text):
                        if unit not in _UNITS:
                            raise ValueError(f"unknown unit {unit!r}")
                        total += int(amount) * _UNITS[unit]
                    return total
                '''),
            "tests/test_durations.py": _d("""
                import pytest

                from durations import parse_duration


                def test_hours_minutes():
                    assert parse_duration("1h30m") == 5400


                def test_unknown_unit():
                    with pytest.raises(ValueError):
                        parse_duration("5x")
                """),
        },
        fix=(
            (
                "durations/core.py",
                '_UNITS = {"h": 3600, "m": 60}',
                '_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}',
            ),
        ),
        wrong=(
            (
                "durations/core.py",
                '_UNITS = {"h": 3600, "m": 60}',
                '_UNITS = {"h": 3600, "m": 60, "s": 1}',
            ),
        ),
        tests={
            "tests/test_durations.py": _d("""
                import pytest

                from durations import parse_duration


                def test_hours_minutes():
                    assert parse_duration("1h30m") == 5400


                def test_unknown_unit():
                    with pytest.raises(ValueError):
                        parse_duration("5x")


                def test_seconds():
                    assert parse_duration("90s") == 90


                def test_days():
                    assert parse_duration("1d2h30m15s") == 95415
                """),
        },
        fail_to_pass=_t("durations", "test_seconds", "test_days"),
        pass_to_pass=_t("durations", "test_hours_minutes", "test_unknown_unit"),
    ),
    TaskDef(
        name="bank",
        issue=_d("""
            A failed transfer still credits the source account

            `transfer(a, b, -10)` raises ValueError (from `b.deposit`), but by then
            `a.withdraw(-10)` has already added 10 to `a`. `withdraw` accepts negative
            amounts at all. Non-positive withdrawals should be rejected, and a transfer
            that fails must leave both balances unchanged.
            """),
        files={
            "bank/__init__.py": "from bank.core import Account, InsufficientFunds, transfer\n",
            "bank/core.py": _d('''
                """Accounts and transfers."""


                class InsufficientFunds(Exception):
                    """A withdrawal larger than the balance."""


                class Account:
                    """A named balance."""

                    def __init__(self, owner, balance=0):
                        self.owner = owner
                        self.balance = balance

                    def deposit(self, amount):
                        """Add a positive ``amount``."""
                        if amount <= 0:
                            raise ValueError("deposits must be positive")
                        self.balance += amount

                    def withdraw(self, amount):
                        """Take ``amount`` out."""
                        if amount > self.balance:
                            raise InsufficientFunds(f"{self.owner} has {self.balance}")
                        self.balance -= amount


                def transfer(src, dst, amount):
                    """Move ``amount`` from ``src`` to ``dst``."""
                    src.withdraw(amount)
                    dst.deposit(amount)
                '''),
            "tests/test_bank.py": _d("""
                import pytest

                from bank import Account, InsufficientFunds, transfer


                def test_transfer():
                    a, b = Account("a", 100), Account("b")
                    transfer(a, b, 30)
                    assert (a.balance, b.balance) == (70, 30)


                def test_overdraft():
                    with pytest.raises(InsufficientFunds):
                        Account("a", 5).withdraw(10)
                """),
        },
        fix=(
            (
                "bank/core.py",
                "        if amount > self.balance:",
                "        if amount <= 0:\n"
                '            raise ValueError("withdrawals must be positive")\n'
                "        if amount > self.balance:",
            ),
        ),
        wrong=(
            (
                "bank/core.py",
                "    src.withdraw(amount)",
                "    if amount < 0:\n"
                '        raise ValueError("negative transfer")\n'
                "    src.withdraw(amount)",
            ),
        ),
        tests={
            "tests/test_bank.py": _d("""
                import pytest

                from bank import Account, InsufficientFunds, transfer


                def test_transfer():
                    a, b = Account("a", 100), Account("b")
                    transfer(a, b, 30)
                    assert (a.balance, b.balance) == (70, 30)


                def test_overdraft():
                    with pytest.raises(InsufficientFunds):
                        Account("a", 5).withdraw(10)


                def test_negative_withdrawal_rejected():
                    a = Account("a", 50)
                    with pytest.raises(ValueError):
                        a.withdraw(-5)
                    assert a.balance == 50


                def test_failed_transfer_changes_nothing():
                    a, b = Account("a", 50), Account("b", 0)
                    with pytest.raises(ValueError):
                        transfer(a, b, -10)
                    assert (a.balance, b.balance) == (50, 0)
                """),
        },
        fail_to_pass=_t(
            "bank", "test_negative_withdrawal_rejected", "test_failed_transfer_changes_nothing"
        ),
        pass_to_pass=_t("bank", "test_transfer", "test_overdraft"),
    ),
    TaskDef(
        name="rpn",
        issue=_d("""
            evaluate() swaps the operands of - and /

            `rpn.evaluate("5 3 -")` returns -2.0 and `evaluate("8 2 /")` returns 0.25.
            In reverse Polish notation the first operand is the one pushed first:
            these should be 2.0 and 4.0.
            """),
        files={
            "rpn/__init__.py": "from rpn.core import evaluate\n",
            "rpn/core.py": _d('''
                """Reverse Polish notation."""

                import operator

                _OPS = {
                    "+": operator.add,
                    "-": operator.sub,
                    "*": operator.mul,
                    "/": operator.truediv,
                }


                def evaluate(expr):
                    """The value of the RPN expression ``expr``."""
                    stack = []
                    for tok in expr.split():
                        if tok in _OPS:
                            a = stack.pop()
                            b = stack.pop()
                            stack.append(_OPS[tok](a, b))
                        else:
                            stack.append(float(tok))
                    if len(stack) != 1:
                        raise ValueError(f"malformed expression: {expr!r}")
                    return stack[0]
                '''),
            "tests/test_rpn.py": _d("""
                import pytest

                from rpn import evaluate


                def test_addition():
                    assert evaluate("2 3 +") == 5.0


                def test_product_of_sum():
                    assert evaluate("2 3 + 4 *") == 20.0


                def test_malformed():
                    with pytest.raises(ValueError):
                        evaluate("1 2")
                """),
        },
        fix=(
            (
                "rpn/core.py",
                "            a = stack.pop()\n            b = stack.pop()",
                "            b = stack.pop()\n            a = stack.pop()",
            ),
        ),
        wrong=(
            (
                "rpn/core.py",
                "stack.append(_OPS[tok](a, b))",
                'stack.append(b - a if tok == "-" else _OPS[tok](a, b))',
            ),
        ),
        tests={
            "tests/test_rpn.py": _d("""
                import pytest

                from rpn import evaluate


                def test_addition():
                    assert evaluate("2 3 +") == 5.0


                def test_product_of_sum():
                    assert evaluate("2 3 + 4 *") == 20.0


                def test_malformed():
                    with pytest.raises(ValueError):
                        evaluate("1 2")


                def test_subtraction_order():
                    assert evaluate("5 3 -") == 2.0


                def test_division_order():
                    assert evaluate("8 2 /") == 4.0
                """),
        },
        fail_to_pass=_t("rpn", "test_subtraction_order", "test_division_order"),
        pass_to_pass=_t("rpn", "test_addition", "test_product_of_sum", "test_malformed"),
    ),
    TaskDef(
        name="textwrap2",
        issue=_d("""
            wrap() produces lines longer than the width

            `textwrap2.wrap("aaa bbb ccc", 6)` returns `["aaa bbb", "ccc"]`; the first line
            has 7 characters. The space between words is not counted. No line may be
            longer than `width` unless it is a single word longer than `width`.
            """),
        files={
            "textwrap2/__init__.py": "from textwrap2.core import wrap\n",
            "textwrap2/core.py": _d('''
                """Greedy line wrapping."""


                def wrap(text, width):
                    """Break ``text`` into lines of at most ``width`` characters."""
                    lines, line = [], ""
                    for word in text.split():
                        if line and len(line) + len(word) > width:
                            lines.append(line)
                            line = word
                        else:
                            line = f"{line} {word}" if line else word
                    if line:
                        lines.append(line)
                    return lines
                '''),
            "tests/test_textwrap2.py": _d("""
                from textwrap2 import wrap


                def test_short_text():
                    assert wrap("hello", 10) == ["hello"]


                def test_long_word_kept_whole():
                    assert wrap("extraordinary", 5) == ["extraordinary"]


                def test_exact_fit():
                    assert wrap("aaa bb", 6) == ["aaa bb"]
                """),
        },
        fix=(
            (
                "textwrap2/core.py",
                "len(line) + len(word) > width",
                "len(line) + 1 + len(word) > width",
            ),
        ),
        wrong=(
            (
                "textwrap2/core.py",
                "len(line) + len(word) > width",
                "len(line) + len(word) > width - 2",
            ),
        ),
        tests={
            "tests/test_textwrap2.py": _d("""
                from textwrap2 import wrap


                def test_short_text():
                    assert wrap("hello", 10) == ["hello"]


                def test_long_word_kept_whole():
                    assert wrap("extraordinary", 5) == ["extraordinary"]


                def test_exact_fit():
                    assert wrap("aaa bb", 6) == ["aaa bb"]


                def test_width_respected():
                    lines = wrap("aaa bbb ccc dd e", 6)
                    assert lines == ["aaa", "bbb", "ccc dd", "e"]
                    assert all(len(line) <= 6 for line in lines)
                """),
        },
        fail_to_pass=_t("textwrap2", "test_width_respected"),
        pass_to_pass=_t(
            "textwrap2", "test_short_text", "test_long_word_kept_whole", "test_exact_fit"
        ),
    ),
)


# ------------------------------------------------------------------------ building

_GIT_ID = {
    "GIT_AUTHOR_NAME": "branchgym",
    "GIT_AUTHOR_EMAIL": "tasks@branchgym.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "branchgym",
    "GIT_COMMITTER_EMAIL": "tasks@branchgym.invalid",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000",
}


def _git(repo: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(_GIT_ID, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null", LC_ALL="C")
    out = subprocess.run(
        ["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise DataError(f"git {' '.join(args)} failed in {repo}: {out.stderr.strip()}")
    return out.stdout


def _write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _diff_of(repo: Path, files: dict[str, str]) -> str:
    """The git diff that turns the base commit into ``files`` (then back to base)."""
    _write(repo, files)
    _git(repo, "add", "-A")
    diff = _git(repo, "diff", "--cached", "--no-color", "--full-index", "HEAD")
    _git(repo, "reset", "-q", "--hard", "HEAD")
    return diff


def _build_one(td: TaskDef, repos: Path) -> dict:
    repo = repos / f"branchgym__{td.name}"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    files = {
        "README.md": f"# {td.name}\n\nA small library (a branchgym generated task).\n",
        ".gitignore": _GITIGNORE,
        **td.files,
    }
    _write(repo, files)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{td.name}: initial version")
    base = _git(repo, "rev-parse", "HEAD").strip()
    task = SWEBenchTask(
        instance_id=td.instance_id,
        repo=f"branchgym/{td.name}",
        base_commit=base,
        problem_statement=td.issue,
        patch=_diff_of(repo, td.fixed_files("fix")),
        test_patch=_diff_of(repo, td.tests),
        fail_to_pass=td.fail_to_pass,
        pass_to_pass=td.pass_to_pass,
        version="1.0",
        environment_setup_commit=base,
        # The tiny repos need no pytest plugins, and autoloading whatever plugins the
        # interpreter has installed (hypothesis, ...) would triple their test time.
        test_cmd=f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {DEFAULT_TEST_CMD}",
        extra={
            "created_at": "2024-01-01T00:00:00Z",
            "branchgym_wrong_patch": _diff_of(repo, td.fixed_files("wrong")),
            "branchgym_fix_command": td.fix_command,
        },
    )
    return task.to_record()


def _fingerprint() -> str:
    blob = json.dumps([FORMAT_VERSION, [dataclasses.astuple(t) for t in TASK_DEFS]], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_generated_tasks(dest: str | os.PathLike[str] | None = None) -> Path:
    """Build the generated repositories and their ``tasks.jsonl`` (once; cached).

    Args:
        dest: Folder to build in (default: ``<cache>/swebench/generated-<fingerprint>``).

    Returns:
        The path of ``tasks.jsonl``; the repositories are in ``repos/`` beside it.
    """
    root = Path(dest) if dest else cache_root() / "swebench" / f"generated-{_fingerprint()}"
    tasks_file = root / "tasks.jsonl"
    if tasks_file.exists():
        return tasks_file
    if shutil.which("git") is None:
        raise DataError("the generated SWE-bench tasks need git; install it (apt-get install git)")
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes build it once
        if tasks_file.exists():
            return tasks_file
        tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        records = [_build_one(td, tmp / "repos") for td in TASK_DEFS]
        (tmp / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        shutil.rmtree(root, ignore_errors=True)
        os.rename(tmp, root)
    return tasks_file


def generated_tasks() -> list[SWEBenchTask]:
    """The generated task set (built on first use)."""
    return load_tasks(build_generated_tasks())


def generated_repos() -> Path:
    """The ``repos_dir`` holding the generated repositories."""
    return build_generated_tasks().parent / "repos"
