"""Coordinated prep (``hp_group``): membership, the shared group state, per-epoch plans, staging and the batch codec."""
