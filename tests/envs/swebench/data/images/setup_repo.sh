#!/bin/bash
# The instance layer: the repository at /testbed (copied in at its base commit instead of
# cloned), installed into `testbed`, and the harness's setup commit.
set -euxo pipefail
cd /testbed
git remote remove origin 2>/dev/null || true
source /opt/miniconda3/bin/activate
conda activate testbed
echo "Current environment: $CONDA_DEFAULT_ENV"
# The install: an editable install's .pth (what `pip install -e .` leaves) ...
site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo /testbed > "$site/__editable__.testbed.pth"
# ... and, as some repositories' installs do, a change to a tracked file.
[ -f README.md ] && printf '\nInstalled into the testbed environment.\n' >> README.md
# Upstream's clean-diff commands: `git diff` then shows only what happens after setup.
git config --global user.email setup@swebench.config
git config --global user.name SWE-bench
git commit --allow-empty -am 'SWE-bench'
