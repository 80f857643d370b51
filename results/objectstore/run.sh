#!/usr/bin/env bash
# A dataset in a bucket 0, 25 and 50 ms away (a real S3 server behind a delay proxy): torch over
# s3torchconnector's S3MapDataset, coordl without and with its look-ahead, and the files on local disk.
# Run from anywhere; the results land in this folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m benchmarks.objectstore --objects 2000 --rtt-ms 0 25 50 --reps 2 --out results/objectstore
