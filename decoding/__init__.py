"""Decoding: proposal, acceptance, back-off and the generation loop.

``generate(model, prompt_ids, DecodeConfig(...), table=stats) -> DecodeResult`` (token ids, text,
trace) runs ``ar``, ``dynamic`` (DynaMo), ``speculative`` (lossless) or ``typical`` decoding.
"""

from .config import DecodeConfig
from .loop import DecodeResult, generate
from .trace import Trace

__all__ = ["DecodeConfig", "DecodeResult", "Trace", "generate"]
