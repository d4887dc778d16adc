"""GRPO post-training of a Qwen-style scene-design agent in JAX/Flax (see README.md)."""

__version__ = "0.1.0"
