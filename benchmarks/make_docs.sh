#!/usr/bin/env bash
# Rebuild docs/benchmarks.md from a run written to docs/benchmarks/ (python benchmarks/run.py --quick --out docs/benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
{
  cat benchmarks/docs_intro.md
  echo "Run environment: $(sed -n 3p docs/benchmarks/summary.md)"
  echo
  sed -e '1,/^## Tutorial block/{/^## Tutorial block/!d}' -e 's#](\([a-z_]*\)\.png)#](benchmarks/\1.png)#' docs/benchmarks/summary.md
} > docs/benchmarks.md
