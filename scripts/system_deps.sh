#!/usr/bin/env bash
# Debian packages the local SWE-bench sandbox uses (bubblewrap, git, patch). Installs the
# missing ones when run as root; otherwise says what to install and exits 0, so the demo
# still runs (SWE-bench then reports what it needs instead of running).
set -uo pipefail
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v git >/dev/null || need+=(git)
command -v patch >/dev/null || need+=(patch)
((${#need[@]})) || exit 0
if [ "$(id -u)" != 0 ]; then
    echo "system_deps: SWE-bench's local sandbox needs ${need[*]}; install them (apt-get install ${need[*]})" >&2
    exit 0
fi
echo "system_deps: installing ${need[*]}"
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || echo "system_deps: could not install ${need[*]}; SWE-bench will say what it needs" >&2
exit 0
