"""Weights kept quantized in memory: GGUF blocks (`gguf_linear`) and int8 per-channel (`int8_linear`)."""
