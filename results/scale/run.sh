#!/usr/bin/env bash
# An epoch from 10k to 1.28M files, coordl against torch, and an ImageNet epoch projected.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.scale --sizes 10000 100000 1281167 --reps 3 --workdir /var/tmp --out results/scale
