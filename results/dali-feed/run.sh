#!/usr/bin/env bash
# coordl-dali against plain DALI reading the files, both decoding on the CPU, at 50% and 100% cache.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.minio --quick --images 4000 --epochs 4 --systems dali-shuffle coordl-dali --fractions 0.5 1.0 --reps 2 --compute-ms 0 --out results/dali-feed
