#!/usr/bin/env bash
# The disk tier: job 1 fills it, job 2 in a new process reads from it, at disk quotas of 100% and 50%, against torch and coordl without it, memory a quarter of the dataset; its cost on a hot path; opening an index of 1.28M items.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.disktier --out results/disktier
