"""Decoding: proposal, acceptance, back-off and the generation loop.

``generate(model, prompt_ids, DecodeConfig(...), table=stats) -> DecodeResult`` (token ids, text,
trace) runs ``ar``, ``dynamic`` (DynaMo), ``speculative`` (lossless) or ``typical`` decoding;
given several prompts (``generate(model, [ids, ...], cfg, seeds=[...])``) it decodes them as one
batch and returns one result per row, each what that row gives alone (``batch.py``).
"""

from .config import DecodeConfig
from .batch import generate, generate_batch
from .loop import DecodeResult
from .trace import Trace

__all__ = ["DecodeConfig", "DecodeResult", "Trace", "generate", "generate_batch"]
