"""The Python API's boundary: what a caller hands ``DecodeConfig`` and ``generate`` is checked by
type (and ids by range) before anything runs, each refusal one ``UsageError`` naming the setting
or argument and what to pass instead. The command line's parsers give these types already; a
Python caller can pass anything (``seed=1.5``, ``max_new_tokens="5"``, a dict as the config, a
path as the table, float or 3-D input ids), which used to fail deep inside with a TypeError or,
worse, decode something else (1.5 truncated to 1, 3-D ids flattened)."""

from __future__ import annotations

import numbers
from dataclasses import MISSING, fields

import numpy as np
import torch

from multitoken.base.errors import UsageError

KINDS = {  # an annotation -> (accepts, what to say)
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)), "an integer"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)), "a number"),
    "bool": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
    "str": (lambda v: isinstance(v, str), "a string"),
}
EITHER = {"tree_nodes": ("int", "str")}  # "auto" or a count, as the command line's text or an int


def _got(value) -> str:
    return f"{value!r:.60} ({type(value).__name__})"


def check_setting_types(group) -> None:
    """Each field of the dataclass ``group`` holds a value of its annotated type (``X | None``:
    X or None); numpy scalars (``np.int64(3)``) become Python's, which torch's seeding takes."""
    for f in fields(group):
        if f.metadata.get("nested"):
            continue
        value = getattr(group, f.name)
        kinds = EITHER.get(f.name) or tuple(t.strip() for t in str(f.type).split("|") if t.strip() != "None")
        if value is None and "None" in str(f.type):
            continue
        fits = next((k for k in kinds if KINDS[k][0](value)), None)
        if fits is not None:
            if isinstance(value, np.generic):
                setattr(group, f.name, {"int": int, "float": float, "bool": bool}[fits](value))
            continue
        what = " or ".join(KINDS[k][1] for k in kinds) + (" or None" if "None" in str(f.type) else "")
        example = f.default if f.default is not MISSING else None
        raise UsageError(f"DecodeConfig: {f.name} must be {what}, got {_got(value)}",
                         f"pass {what}, e.g. {f.name}={example!r}")


def check_group(name: str, cls, value):
    """A group given to ``DecodeConfig(...)``: an instance of ``cls`` or a dict of its settings."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise UsageError(f"DecodeConfig: {name} has no setting {unknown[0]!r}",
                             f"its settings: {', '.join(f.name for f in fields(cls))}")
        return cls(**value)
    if not isinstance(value, cls):
        raise UsageError(f"DecodeConfig: {name} must be a {cls.__name__} or a dict of its settings, got {_got(value)}",
                         f"pass {name}={cls.__name__}(...), or the settings themselves: DecodeConfig(greedy=True, ...)")
    return value


def unknown_setting(key: str, known: set[str]) -> UsageError:
    import difflib

    close = difflib.get_close_matches(key, sorted(known), n=1)
    return UsageError(f"DecodeConfig has no setting {key!r}",
                      f"did you mean {close[0]!r}?" if close else f"its settings: {', '.join(sorted(known))}")


def check_call(model, cfg, table, config_cls) -> None:
    """``generate``'s model, config (an instance of ``config_cls``, or None) and table, before
    any is used."""
    if model is None or not all(hasattr(model, a) for a in ("backbone", "step", "new_caches", "n_future")):
        raise UsageError(f"generate: model must be a model with heads (a MultiTokenModel), got {_got(model)}",
                         "load one with MultiTokenModel.from_pretrained(base, heads_dir)")
    if cfg is not None and not isinstance(cfg, config_cls):
        fix = "pass DecodeConfig(**settings)" if isinstance(cfg, dict) else "pass a DecodeConfig, or None for the defaults"
        raise UsageError(f"generate: the config must be a DecodeConfig, got {_got(cfg)}", fix)
    if table is not None and not callable(getattr(table, "mask", None)):
        path = isinstance(table, (str, bytes)) or hasattr(table, "__fspath__")
        raise UsageError(f"generate: table must be a co-occurrence table, got {_got(table)}",
                         f"load it first: CooccurrenceTable({str(table)!r}) (multitoken.stats)" if path
                         else "pass a CooccurrenceTable (multitoken.stats), or None")


ID_FIX = "pass token ids as integers: a [T] or [B, T] torch.long tensor, or lists of ints (tokenizer(text).input_ids)"


def check_prompt_ids(prompts, attention_mask) -> None:
    """Token ids as integers: a 1-D or 2-D integer tensor, or lists of ints (or 1-D tensors /
    arrays of integers)."""
    if isinstance(prompts, torch.Tensor):
        _integer_tensor(prompts)
        if prompts.dim() not in (1, 2):
            raise UsageError(f"generate: input ids must be [T] or [B, T], got a {prompts.dim()}-D tensor of shape "
                             f"{list(prompts.shape)}", ID_FIX)
        if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor)
                                               and attention_mask.numel() == prompts.numel()):
            got = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else _got(attention_mask)
            raise UsageError(f"generate: attention_mask must be a tensor shaped like the input ids {list(prompts.shape)}, "
                             f"got {got}", "pass the attention_mask the tokenizer gave with the ids")
        return
    if isinstance(prompts, np.ndarray):
        if prompts.dtype.kind not in "iu" or prompts.ndim not in (1, 2):
            raise UsageError(f"generate: input ids must be a 1-D or 2-D array of integers, got a {prompts.ndim}-D "
                             f"{prompts.dtype} array", ID_FIX)
        return
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise UsageError(f"generate: prompts must be token ids, got {_got(prompts)}",
                         ID_FIX + "; encode text with the model's tokenizer first")
    for row in [prompts] if len(prompts) and _scalar(prompts[0]) else prompts:
        if isinstance(row, torch.Tensor):
            _integer_tensor(row)
        elif isinstance(row, np.ndarray):
            if row.dtype.kind not in "iu" or row.ndim > 1:
                raise UsageError(f"generate: a prompt must be a 1-D array of integer ids, got a {row.ndim}-D {row.dtype} array", ID_FIX)
        elif isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
            raise UsageError(f"generate: a prompt must be a list of token ids, got {_got(row)}", ID_FIX)
        else:
            bad = next((v for v in row if not _is_id(v)), None)
            if bad is not None or any(isinstance(v, torch.Tensor) and v.dim() for v in row):
                raise UsageError(f"generate: input ids must be integers, got {_got(bad)}", ID_FIX)


def check_seeds(seeds) -> None:
    if seeds is None:
        return
    if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__iter__"):
        raise UsageError(f"generate: seeds must be a list of integers, one per prompt, got {_got(seeds)}",
                         "pass seeds=[0, 1, ...], or leave it out for the config's seed")
    bad = next((s for s in seeds if not KINDS["int"][0](s)), None)
    if bad is not None:
        raise UsageError(f"generate: seeds must be integers, got {_got(bad)}", "pass seeds=[0, 1, ...]")


def _integer_tensor(t: torch.Tensor) -> None:
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise UsageError(f"generate: input ids must be integers, got a {t.dtype} tensor", ID_FIX)


def _scalar(v) -> bool:
    return isinstance(v, (numbers.Number, np.generic)) or (isinstance(v, torch.Tensor) and v.dim() == 0)


def _is_id(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not (v.dtype == torch.bool or v.dtype.is_floating_point)
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def check_vocab(prompts: list[list[int]], vocab: int) -> None:
    """Every id within the model's vocabulary [0, vocab)."""
    for ids in prompts:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise UsageError(f"generate: token id {bad} is outside the model's vocabulary [0, {vocab})",
                             "encode the prompt with this model's own tokenizer")
