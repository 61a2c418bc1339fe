#!/usr/bin/env bash
# Run one GPU check section (or all, in order) under its time limit, appending to OUT/log.txt.
# Usage: bash benchmarks/gpu_rerun.sh SECTION|all OUT      (sections: python benchmarks/gpu_check.py --dry-run)
set -uo pipefail
which="${1:?usage: bash benchmarks/gpu_rerun.sh SECTION|all OUT}"
out="${2:?usage: bash benchmarks/gpu_rerun.sh SECTION|all OUT}"
[ "${out#/}" != "$out" ] || out="$PWD/$out"  # OUT as the caller wrote it, from the caller's folder
cd "$(dirname "$0")/.."
mkdir -p "$out"
log="$out/log.txt"
python -c "import dmuon" 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# "name seconds" per line, from the plan, so that the limits live in one place
python benchmarks/gpu_check.py --dry-run | awk 'NR > 2 && $1 != "total:" {print $1, $2}' |
while read -r name limit; do
    if [ "$which" != all ] && [ "$which" != "$name" ]; then continue; fi
    start=$SECONDS
    echo "== $name (limit $limit s)" >> "$log"
    timeout --kill-after=5 "$limit" python benchmarks/gpu_check.py "$name" --out "$out" >> "$log" 2>&1
    code=$?
    echo "== $name: exit $code after $((SECONDS - start)) s" >> "$log"
done
