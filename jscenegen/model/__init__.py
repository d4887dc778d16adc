"""Qwen2/2.5 and Qwen3 decoders as Flax NNX modules, HF I/O, KV cache, sampler, tokenizer."""
