"""Continual learning: the experience stream, the rehearsal buffer, and the batches that mix them."""
