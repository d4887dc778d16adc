"""The architectures (config.json `model_type`) and size presets jscenegen builds and loads.

The configs and the commands read these names from here (`model.config`'s PRESETS and
HYBRID_PRESETS hold one entry per preset name; a test keeps them equal); this module imports
nothing, so `jscenegen --help` builds its parsers without pydantic or JAX.
"""
ARCHS = ("qwen2", "qwen3", "qwen3_5")
PRESET_NAMES = ("micro", "tiny", "small")
