#!/usr/bin/env bash
# Where items are cached across servers: first come against hashing, simulated.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.placement --out results/placement
