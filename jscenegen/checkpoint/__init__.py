"""Checkpoints: the orbax store, metadata, checksums and resume (imported by module)."""

RUN_CHECKPOINTS = "checkpoints"
"""A training run's checkpoint directory, `RUN_DIR/checkpoints/<step>/` (the store's root)."""
