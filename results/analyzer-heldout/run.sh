#!/usr/bin/env bash
# coordl analyze on a grid it was not tuned on: two other datasets, raw bytes and decoded images, batches of 8 to 64, 0 to 4 workers, prep-bound rows.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.heldout --out results/analyzer-heldout
