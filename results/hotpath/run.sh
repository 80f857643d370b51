#!/usr/bin/env bash
# coordl against torch when only the loader is slow: images and raw bytes, 0/1/2/8 workers.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.hotpath --images 4000 --workers 0 1 2 8 --reps 3 --out results/hotpath
