"""Decoding with multi-token heads from plain transformers code.

``with_heads(HEADS)`` returns a decoding method for transformers' own ``generate``::

    model = AutoModelForCausalLM.from_pretrained(str(fetched_dir("SmolLM2-135M-Instruct")))
    out = model.generate(ids, max_new_tokens=64, do_sample=False,
                         custom_generate=with_heads("embedded:SmolLM2-135M-Instruct-conditioned", tree="static"))

``HEADS`` is a heads dir or ``embedded:NAME`` / ``fetched:NAME``, as on the command line.
transformers prepares the inputs and the generation config as usual and then calls the method
in place of its own sampling loop (a callable ``custom_generate`` runs no remote code, so no
``trust_remote_code``); the method decodes with the heads (``decoding.generate``, every row of a
batch on its own) and returns the sequences as ``generate`` does: the prompts followed by the new
tokens, padded with the pad token. Greedy (``do_sample=False``) output is transformers' greedy
output token for token. Sampling reads ``temperature``, ``top_k`` and ``repetition_penalty``
(DynaMo's form: the probability of a token already in the context divided by it) from the
generation config; other logits processors have no counterpart and are refused. The heads are
loaded once per model object and heads dir, however many ``with_heads`` calls name them; the
model's linears stay as the caller built them. A tree's size (``tree_nodes`` auto, the default)
comes from the verify step's time on this machine, measured once per CPU, thread count and model
shape and kept in ``STEP_TIMES_FILE`` under the cache (``multitoken.embedded.cache_dir``).
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from multitoken.base.errors import UsageError
from multitoken.base.tokenizer import load_tokenizer
from multitoken.decoding.engine import generate_batch, prompt_rows
from multitoken.decoding.config import DecodeConfig
from multitoken.embedded import cache_dir, resolve_base
from multitoken.pipeline.sources.assets import load_stats
from multitoken.pipeline.model.backbone import Backbone
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.kernels.cpu_linear import STOCK
from multitoken.pipeline.model.model import MultiTokenModel

# transformers' processors that the generation config's sampling fields create and that the
# method applies itself; any other processor (or a user's own) has no counterpart here.
HANDLED = {"TemperatureLogitsWarper", "TopKLogitsWarper", "RepetitionPenaltyLogitsProcessor"}
STEP_TIMES_FILE = "step_times.json"  # under cache_dir(): tree verify-step times per machine and model shape
# The model object's attribute holding (heads dir, stats dir) -> (MultiTokenModel, table): heads
# attached once per model, whichever with_heads call asks (a README-style call builds a new
# method every time); on the model itself, so they go when it goes.
ATTACHED = "_multitoken_heads"


def with_heads(heads: str, stats: str | None = None, **decode) -> callable:
    """A ``custom_generate`` method decoding with the heads in ``heads`` (a heads dir, or
    ``embedded:NAME`` / ``fetched:NAME``) and co-occurrence ``stats`` (same forms; DynaMo / joint
    drafts); ``decode``: other ``DecodeConfig`` fields (mode, tree, tree_nodes, eps_b, ...)."""
    heads = resolve_base(str(heads))
    stats = resolve_base(str(stats)) if stats is not None else None
    if not (Path(heads) / "heads_config.json").is_file():
        raise UsageError(f"{heads!r} is not a heads dir (no heads_config.json)",
                         "pass a directory made by `multitoken attach` / `multitoken train`, or embedded:NAME for "
                         "heads the package ships (embedded:stories260K-heads, embedded:SmolLM2-135M-Instruct-conditioned)")

    def multitoken_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=False, streamer=None, **model_kwargs) -> torch.LongTensor:
        attached = getattr(model, ATTACHED, None)
        if attached is None:
            attached = {}
            setattr(model, ATTACHED, attached)
        if (heads, stats) not in attached:
            attached[(heads, stats)] = _attach(model, heads, stats)
        mt, table = attached[(heads, stats)]
        extra = sorted({type(p).__name__ for p in logits_processor} - HANDLED)
        if extra:
            raise UsageError(f"with_heads cannot apply {', '.join(extra)}",
                             "drop those generation options, or decode with transformers' own generate")
        cfg = _decode_config(generation_config, decode, input_ids.shape[1])
        rows = prompt_rows(input_ids, model_kwargs.get("attention_mask"))
        results = generate_batch(mt, rows, cfg, table=table)
        return _sequences(input_ids, [r.token_ids for r in results], generation_config)

    return multitoken_generate


def _attach(model, heads: str, stats: str | None):
    """The heads on ``model`` itself (its weights checked against the heads' base)."""
    name = str(model.config._name_or_path)
    dtype = str(model.dtype).removeprefix("torch.")
    backbone = Backbone(model, load_tokenizer(name), name,
                        BackboneConfig(base=name, dtype=dtype, device=str(model.device), cpu_linear=STOCK))
    mt = MultiTokenModel.from_pretrained(backbone, heads)
    mt.step_times_store = (cache_dir() / STEP_TIMES_FILE, _machine_and_shape(mt))  # decoding.trees.step_times
    return mt, load_stats(stats, backbone.tokenizer)


def _machine_and_shape(mt: MultiTokenModel) -> str:
    """What a verify step's time depends on: the CPU, torch's threads (at the first call), the
    device (a GPU's name too), the weights' shapes and dtype, the linears, the heads. The key of this model's step times in ``STEP_TIMES_FILE``."""
    shape, device = mt.backbone.fingerprint(), mt.backbone.device
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    return "|".join([
        f"cpu={_cpu_name()}", f"threads={torch.get_num_threads()}", f"device={device}{gpu}",
        f"dtype={mt.backbone.model.dtype}", f"linear={mt.backbone.load_config.cpu_linear}",
        *(f"{k}={shape[k]}" for k in ("model_type", "vocab_size", "hidden_size", "num_layers")),
        f"heads={mt.config.head_type}x{mt.n_future}"])


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _decode_config(gc, decode: dict, prompt_len: int) -> DecodeConfig:
    new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or prompt_len + 20) - prompt_len
    fields = dict(max_new_tokens=new, greedy=not gc.do_sample)
    if gc.do_sample:
        fields.update(temperature=gc.temperature or 1.0, top_k=gc.top_k or 50,
                      repetition_penalty=gc.repetition_penalty or 1.0)
    cfg = DecodeConfig(**{"mode": "speculative", **fields, **decode}).resolved()
    cfg.validate()
    return cfg


def _sequences(input_ids: torch.Tensor, new: list[list[int]], gc) -> torch.LongTensor:
    """The prompts as given (their padding kept) then each row's new tokens, right-padded."""
    pad = gc.pad_token_id if gc.pad_token_id is not None else (gc.eos_token_id if isinstance(gc.eos_token_id, int) else 0)
    width = max(len(t) for t in new)
    tail = torch.full((input_ids.shape[0], width), int(pad), dtype=input_ids.dtype, device=input_ids.device)
    for i, tokens in enumerate(new):
        tail[i, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, tail], dim=1)  # [B, T + new]
