#!/usr/bin/env bash
# K jobs on one machine, coordinated prep against each job on its own: prep-bound (200 MB/s), torch at K = 2, 4, 8 and DALI at K = 4.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
for k in 2 4 8; do python3 -m benchmarks.coordprep --jobs $k --read-mbps 200 --reps 3 --drop-page-cache --out results/coordprep/torch-k$k; done
python3 -m benchmarks.coordprep --jobs 4 --backend dali --read-mbps 200 --reps 3 --drop-page-cache --out results/coordprep/dali-k4
