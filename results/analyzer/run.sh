#!/usr/bin/env bash
# coordl analyze's prediction against the measured run: the one-server grid, two servers, the DALI backend; memory bounded.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.analyzer --out results/analyzer/one-server --epochs 4 --workers 1 2 --servers 0 --analyses 3
python3 -m benchmarks.analyzer --out results/analyzer/two-servers --epochs 4 --workers 1 --analyses 3 --multi-server-only
python3 -m benchmarks.analyzer --out results/analyzer/dali --backend dali --servers 0 --workers 2 --fractions 0 0.5 1.0 --mbps 10 40 --epochs 4 --analyses 3
