#!/bin/bash
# before (ed65dfb with the benchmark of the after tree) and after, one after the other, twice
set -e
AFTER=$(git -C /var/tmp/bench-after rev-parse --short HEAD)
for round in 1 2; do
  for tree in before after; do
    sha=$([ $tree = before ] && echo ed65dfb || echo $AFTER)
    echo "== round $round $tree ($sha) $(date -u +%T)"
    (cd /var/tmp/bench-$tree && PYTHONPATH=/var/tmp/bench-$tree python3 -m benchmarks.gpu_stall --device cpu --steps none \
      --systems coordl-dali,dali --images 2048 --batch-size 128 --epochs 6 --trials 3 --workers 2 --git-sha $sha \
      --out /work/main/results/dali-edge-cpu-$AFTER/$tree-$round)
  done
done
echo "== done $(date -u +%T)"
