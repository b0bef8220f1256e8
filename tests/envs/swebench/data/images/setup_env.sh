#!/bin/bash
# The env layer: /opt/miniconda3 with `activate` and a `testbed` environment.
set -euxo pipefail
root=/opt/miniconda3
mkdir -p "$root/bin" "$root/condabin" "$root/etc/profile.d" "$root/envs/testbed/bin"

# The `conda` shell function, as much of it as eval scripts use: activate / deactivate.
cat > "$root/etc/profile.d/conda.sh" <<'CONDA'
_conda_strip() { local p=":$PATH:"; p="${p//:$1\/bin:/:}"; p="${p#:}"; PATH="${p%:}"; }
conda() {
    local name prefix
    case "${1:-}" in
    activate)
        name="${2:-base}"
        if [ "$name" = base ]; then prefix=/opt/miniconda3; else prefix="/opt/miniconda3/envs/$name"; fi
        if [ ! -d "$prefix/bin" ]; then
            echo "EnvironmentNameNotFound: Could not find conda environment: $name" >&2
            return 1
        fi
        if [ -n "${CONDA_PREFIX:-}" ]; then _conda_strip "$CONDA_PREFIX"; fi
        export PATH="$prefix/bin:$PATH" CONDA_PREFIX="$prefix" CONDA_DEFAULT_ENV="$name"
        export CONDA_SHLVL=1 CONDA_PROMPT_MODIFIER="($name) "
        ;;
    deactivate)
        if [ -n "${CONDA_PREFIX:-}" ]; then _conda_strip "$CONDA_PREFIX"; fi
        unset CONDA_PREFIX CONDA_DEFAULT_ENV CONDA_PROMPT_MODIFIER
        export CONDA_SHLVL=0
        ;;
    *)
        echo "conda $*: only activate and deactivate exist in this image" >&2
        return 1
        ;;
    esac
}
CONDA
printf '. /opt/miniconda3/etc/profile.d/conda.sh\nconda activate "${1:-base}"\n' > "$root/bin/activate"

# `testbed`: a virtual environment over the system python (what `python -m venv
# --system-site-packages` writes; the minimal base image has no venv module).
py="$(python3 -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
env="$root/envs/testbed"
printf 'home = /usr/bin\ninclude-system-site-packages = true\n' > "$env/pyvenv.cfg"
ln -s /usr/bin/python3 "$env/bin/python3"
ln -s python3 "$env/bin/python"
mkdir -p "$env/lib/$py/site-packages"
printf '#!/bin/sh\nexec /opt/miniconda3/envs/testbed/bin/python -m pytest "$@"\n' > "$env/bin/pytest"
chmod +x "$env/bin/pytest"
echo "source /opt/miniconda3/etc/profile.d/conda.sh && conda activate testbed" > /root/.bashrc
