#!/usr/bin/env bash
# The page cache against MinIO on throttled storage with memory bounded: torch, DALI and coordl at 50% and 100% cache.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.minio --quick --out results/minio
