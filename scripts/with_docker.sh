#!/usr/bin/env bash
# Run a command (the test suite) with what the SWE-bench tests need on this machine:
# bubblewrap, git, a running Docker daemon and the offline-built base image; and the
# distribution's chromium, which the viewer tests drive through playwright.
#
#   scripts/with_docker.sh .venv/bin/python -m pytest
#
# Missing Debian packages are installed (root). A daemon that already answers is used as
# it is; otherwise dockerd is started in the background and stopped by its pid when the
# command ends, whether it passed or failed. BRANCHGYM_REQUIRE_DOCKER=1 tells the tests
# that Docker must be there: a Docker test that cannot reach it fails instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v git >/dev/null || need+=(git)
command -v patch >/dev/null || need+=(patch)
command -v chromium >/dev/null || need+=(chromium)
if ((${#need[@]})); then
    if [ "$(id -u)" != 0 ]; then
        echo "with_docker: need root to install ${need[*]} (or install them yourself)" >&2
        exit 1
    fi
    echo "with_docker: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

DOCKERD_PID=""
stop_dockerd() {
    if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
        echo "with_docker: stopping dockerd (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID" 2>/dev/null || true
        for _ in $(seq 1 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
        kill -9 "$DOCKERD_PID" 2>/dev/null || true
    fi
}
trap stop_dockerd EXIT

if ! docker info >/dev/null 2>&1; then
    LOG="${TMPDIR:-/tmp}/branchgym-dockerd.log"
    echo "with_docker: starting dockerd (log: $LOG)"
    dockerd >"$LOG" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -20 "$LOG" >&2; echo "with_docker: dockerd died" >&2; exit 1; }
        sleep 1
    done
    docker info >/dev/null 2>&1 || { tail -20 "$LOG" >&2; echo "with_docker: dockerd did not answer in 60 s" >&2; exit 1; }
fi

scripts/swebench_docker_image.sh
export BRANCHGYM_REQUIRE_DOCKER=1
set +e
"$@"
status=$?
set -e
exit "$status"
