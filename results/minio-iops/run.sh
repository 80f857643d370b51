#!/usr/bin/env bash
# Random reads that cost a request each: 150 MB/s and 150 IOPS at 50% and 100% cache.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.minio --quick --read-mbps 150 --read-iops 150 --out results/minio-iops
