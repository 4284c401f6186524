"""Training: the loop (heads only, joint LoRA, warm-up, DynaMo's three rates), optimiser groups,
the training config, resumable checkpoints, and the self-distillation corpus sampler.

Imports nothing eagerly.
"""
