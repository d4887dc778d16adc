"""The architectures (config.json `model_type`) and size presets jscenegen builds and loads.

The configs, the commands and `model.config.preset_config` read these names from here; this
module imports nothing, so `jscenegen --help` builds its parsers without pydantic or JAX.
"""
ARCHS = ("qwen2", "qwen3", "qwen3_5")
PRESET_NAMES = ("micro", "tiny", "small")
