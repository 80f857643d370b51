#!/usr/bin/env bash
# Building the loader over ImageNet's 1,281,167 files against torchvision's ImageFolder.
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.construction --files 1281167 --classes 1000 --workdir /var/tmp --trials 5 --out results/construction
