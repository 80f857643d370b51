#!/usr/bin/env bash
# PyTorch's own DataLoader tests, with torch's DataLoader and with coordl's swapped in. $1: pytorch's test/test_dataloader.py (pip install expecttest).
# Run from anywhere (as root where the benchmark throttles storage); the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 tools/torch_dataloader_suite.py "$1" --out results/torch-suite/result.json
