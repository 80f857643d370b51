#!/usr/bin/env bash
# Locality-aware batches: the imbalance of per-rank shares, simulated.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.locality --out results/locality-sim
