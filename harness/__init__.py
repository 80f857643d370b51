"""What the tests and the benchmarks share: simulated servers (network and mount namespaces) and storage environments (loop disks, throttled cgroups)."""
