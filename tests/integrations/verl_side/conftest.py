"""These tests import verl, which lives in its own venv (`make verl-venv`, .venv-verl).

The main suite runs them there through tests/integrations/test_verl.py; collected from a
Python without verl they are left out here (that test says why, or fails in CI).
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("verl") else ["test_*.py"]
