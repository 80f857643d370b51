#!/usr/bin/env bash
# The what-if's knees (the smallest cache, the fewest workers that reach the best rate) against measured ones.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.knees --out results/knees
