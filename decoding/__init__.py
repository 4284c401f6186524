"""Decoding: one engine for every mode, proposers, verifiers and DynaMo's back-off.

``generate(model, prompt_ids, DecodeConfig(...), table=stats) -> DecodeResult`` (token ids, text,
trace) runs ``ar``, ``dynamic`` (DynaMo), ``speculative`` (lossless) or ``typical`` decoding;
given several prompts (``generate(model, [ids, ...], cfg, seeds=[...])``) it decodes them as one
batch and returns one result per row, each what that row gives alone (``engine.py``).
"""

from .config import DecodeConfig
from .engine import DecodeResult, generate, generate_batch
from .trace import Trace

__all__ = ["DecodeConfig", "DecodeResult", "Trace", "generate", "generate_batch"]
