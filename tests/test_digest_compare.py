import subprocess
import sys
from collections import deque

import numpy as np
import pytest

from branchgym.compare import first_difference
from branchgym.digest import stable_hash

VALUE = {"a": [1, 2.5, "x"], "b": np.arange(6).reshape(2, 3), "c": (None, True), "d": {3, 1}}


def test_stable_hash_is_stable_across_processes():
    code = (
        "import numpy as np; from branchgym.digest import stable_hash;"
        "print(stable_hash({'a': [1, 2.5, 'x'], 'b': np.arange(6).reshape(2, 3),"
        " 'c': (None, True), 'd': {3, 1}}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == stable_hash(VALUE)


@pytest.mark.parametrize(
    "a,b",
    [
        ([1, 2], (1, 2)),
        (1, 1.0),
        (np.zeros(3, np.float32), np.zeros(3, np.float64)),
        ("ab", "ba"),
        ({"x": 1}, {"x": 2}),
        (deque([1]), [1]),
        (np.random.default_rng(0), np.random.default_rng(1)),
    ],
)
def test_stable_hash_distinguishes(a, b):
    assert stable_hash(a) != stable_hash(b)


def test_stable_hash_rejects_unknown_types():
    with pytest.raises(TypeError, match="cannot hash"):
        stable_hash(object())


def test_first_difference_reports_path():
    a = {"obs": np.array([1.0, 2.0]), "info": {"k": [1, 2, 3]}}
    b = {"obs": np.array([1.0, 2.0]), "info": {"k": [1, 2, 4]}}
    d = first_difference(a, b)
    assert d is not None and d.path == "['info']['k'][2]" and (d.left, d.right) == (3, 4)
    assert first_difference(a, a) is None
    assert first_difference({"t": 1, "x": 2}, {"t": 5, "x": 2}, ignore=("t",)) is None
    assert first_difference(np.array([np.nan]), np.array([np.nan])) is None
    assert first_difference(1.0, 1.0 + 1e-9) is not None
    assert first_difference(1.0, 1.0 + 1e-9, atol=1e-6) is None
    assert first_difference([1, 2], [1, 2, 3]).path == "len(<value>)"
