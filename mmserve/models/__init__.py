"""Model adapters (LLaVA; next Qwen2-VL), the KV buffers they step over, and the demo-model builder.
May import cache and the bottom layer."""
