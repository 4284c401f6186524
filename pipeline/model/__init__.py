"""Model core: load a backbone (frozen, LoRA, 4/8-bit), attach heads (``MultiTokenModel``),
save/load heads dirs, draft vocabularies, quantization, Medusa export / import.

Imports nothing eagerly; public names are re-exported lazily by ``multitoken.pipeline``.
"""
