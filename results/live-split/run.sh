#!/usr/bin/env bash
# What the live split's timers cost: the loader with them on against off, many short rounds.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.live_split --out results/live-split
