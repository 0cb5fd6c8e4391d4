#!/usr/bin/env bash
# Lightning's own multi-process CPU tests with its DDP strategy strings swapped for ours (no test edited).
# usage: tests/lightning_suite/run.sh LIGHTNING_TESTS_DIR STAGE   (STAGE 0: DDP itself, the baseline)
# LIGHTNING_TESTS_DIR is the tests/ folder of Lightning's repository at the installed version's tag.
set -u
tests=$1; stage=$2
here=$(cd "$(dirname "$0")" && pwd)
cd "$tests/tests_pytorch" || exit 2
export OMP_NUM_THREADS=1 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" SWAP_STAGE=$stage SWAP_VERBOSE=1
while read -r line; do
  [ -z "$line" ] && continue
  # shellcheck disable=SC2086  # a line may hold several test ids of one file
  timeout 600 python -m pytest -p no:cacheprovider -p swap_strategy -q -rfE $line 2>&1 | tail -n 3
done < "$here/selection.txt"
