"""Model core: load a backbone (frozen, LoRA, 4/8-bit), attach heads (``MultiTokenModel``),
save/load heads dirs, incremental decoding steps with KV caches, llama2.c checkpoint conversion.

Imports nothing eagerly; public names are re-exported lazily by ``multitoken.pipeline``.
"""
