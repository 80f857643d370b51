#!/usr/bin/env bash
# Rehearsal: final accuracy of a class-incremental stream through coordl against the same protocol in plain torch (5 seeds, with and without augmentation), and samples/s with rehearsal against without over 20 experiences.
# Run from anywhere; the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.rehearsal --reps 5 --out results/rehearsal
