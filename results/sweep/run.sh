#!/usr/bin/env bash
# Where coordl's advantage over the page cache ends: storage bandwidth from 5 to 80 MB/s at 50% cache.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.sweep --read-mbps 5 20 80 --reps 3 --out results/sweep
