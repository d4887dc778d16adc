"""Mesh construction (single and multi-host), FSDP2-style parameter sharding, batch sharding."""
