#!/usr/bin/env bash
# The DALI backend's samples/s: the feed alone, DALI's CPU decode, the torch backend; then the feed under a stand-in training step against plain DALI's reader.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.dali_throughput --images 1500 --epochs 3 --workers 2 --reps 3 --out results/dali-throughput/no-step
python3 -m benchmarks.dali_throughput --images 6000 --epochs 6 --workers 2 --batch-size 256 --step-ms 4 14 --systems feed dali-feed --reps 3 --out results/dali-throughput/step
