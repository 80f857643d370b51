"""Epochs: the batch sampler's plans, the per-epoch ledger of statistics, mid-epoch resume state."""
