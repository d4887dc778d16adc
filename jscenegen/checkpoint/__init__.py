"""Checkpoints: the orbax store, metadata, checksums and resume (imported by module)."""
