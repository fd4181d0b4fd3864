#!/usr/bin/env bash
# The device check in one command, on a fresh machine (a GPU one, or the CPU at small
# sizes): a virtual environment, cockpit with its test extra, then
# `python -m benchmarks.device` (the CUDA tests, 3C3D against cockpit-for-pytorch
# 1.0.2, GPT-2 against vmap(grad), peak CUDA memory), which writes
# benchmarks/results/device_<device>.md. Extra arguments go to benchmarks.device.
#
# The torch present is kept (a GPU machine's own CUDA build): the environment sees
# the system's packages and pip is pinned to that torch.
# Offline, point COCKPIT_WHEELS at a folder of wheels (pip download ...) and pip
# installs from there alone, the 1.0.2 reference included. COCKPIT_DEVICE_PYTHON
# names an interpreter that has everything already (no environment, no install).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
venv=${COCKPIT_DEVICE_VENV:-.venv-device}
if [ -n "${COCKPIT_DEVICE_PYTHON:-}" ]; then
    python=$COCKPIT_DEVICE_PYTHON
else
    if [ -n "${COCKPIT_WHEELS:-}" ]; then
        export PIP_NO_INDEX=1 PIP_FIND_LINKS="$COCKPIT_WHEELS"
    fi
    constraints=constraints.txt
    if python3 -c "import torch" 2>/dev/null; then  # a machine's own build (CUDA)
        echo "device check: keeping the torch present ($(python3 -c 'import torch; print(torch.__version__, torch.cuda.is_available())'))"
        python3 -m venv --system-site-packages "$venv"
        constraints=$(mktemp)
        grep -v -i '^torch\b' constraints.txt > "$constraints"
        echo "torch==$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')" >> "$constraints"
    else
        python3 -m venv "$venv"
    fi
    if ! "$venv/bin/pip" install -q -c "$constraints" -e ".[test]"; then
        echo "device check: pip install failed (offline? set COCKPIT_WHEELS); using the packages present" >&2
    fi
    "$venv/bin/pip" uninstall -q -y torchvision 2>/dev/null || true
    "$venv/bin/python" -c "import torch, backpack, pytest; print('device check: torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    python=$venv/bin/python
fi
status=0
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \
    "$python" -m benchmarks.device "$@" || status=$?
echo "device check: $(( $(date +%s) - started )) s in all, status $status"
exit $status
