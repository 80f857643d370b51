#!/usr/bin/env bash
# Partitioned caching across 2 and 4 servers (network namespaces, throttled disks), and more data per epoch on 4.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.partitioned --nodes 2 --out results/partitioned/n2
python3 -m benchmarks.partitioned --nodes 4 --out results/partitioned/n4
python3 -m benchmarks.partitioned --nodes 4 --files 1600 --epochs 6 --read-mbps 8 --out results/partitioned/n4-1600
