"""What a configuration costs on a device: per-block time folded from a step's priced ops, and the
step's timeline with re-runs and copies."""
