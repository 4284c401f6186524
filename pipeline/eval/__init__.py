"""Evaluation: per-head perplexity and top-k, PPL_1:n and DynaMo's PPL_d, the marginalization
baseline, the logit lens, speed-up formulas, and the eps_b sweep with its plots.

Imports nothing eagerly.
"""
