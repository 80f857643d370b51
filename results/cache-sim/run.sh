#!/usr/bin/env bash
# The page cache (LRU) against MinIO under per-epoch shuffles, simulated.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.cache_sim --out results/cache-sim
