#!/usr/bin/env bash
# Every GPU check in one call, on one GPU, within 8 minutes, into at most 8 files of OUT:
#   log.txt (versions, the GPU, each section's output, seconds and exit code) and one JSON per
#   section (benchmarks/gpu_check.py says what each answers; --dry-run prints the plan).
# The machine may be bare and offline: dmuon is installed into its own torch without the network.
# Each section runs under its own time limit, so one that fails or hangs costs only itself.
# Usage: bash benchmarks/gpu_check.sh OUT [--dry-run]      Rerun one section: benchmarks/gpu_rerun.sh
set -uo pipefail
out="${1:?usage: bash benchmarks/gpu_check.sh OUT [--dry-run]}"
[ "${out#/}" != "$out" ] || out="$PWD/$out"  # OUT as the caller wrote it, from the caller's folder
cd "$(dirname "$0")/.."
if [ "${2:-}" = "--dry-run" ]; then
    exec python benchmarks/gpu_check.py --dry-run
fi
mkdir -p "$out"
log="$out/log.txt"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
    echo "== setup"
    start=$SECONDS
    # the device's torch stays: no build isolation, no dependencies, no index
    timeout 15 pip install --no-build-isolation --no-deps --no-index -q -e . \
        || echo "pip install failed: running from the source tree (PYTHONPATH)"
    python -c "import dmuon" 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    python -c "import sys, torch, dmuon; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '| dmuon', dmuon.__version__)
try:
    import triton; print('triton', triton.__version__)
except ImportError:
    print('triton: not installed')"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    python benchmarks/gpu_check.py --dry-run
    echo "setup: $((SECONDS - start)) s"
} >> "$log" 2>&1
bash benchmarks/gpu_rerun.sh all "$out"
