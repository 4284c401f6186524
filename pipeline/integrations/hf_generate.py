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
generation config; other logits processors have no counterpart and are refused.

Linears: the heads decode on our CPU linears (``cpu_linear=``, default ``rows``: the compiled
kernel over the weights' own codes, docs/kernels.md), as ``multitoken generate`` does. They run
on a *runner*: a copy of the caller's module tree whose Parameters are new objects over the same
storage, packed there; the caller's model object is never changed. Not in place, because our
kernels are not torch's float32 linear bit for bit (one chain of fused multiply-adds per output,
where MKL sums in blocks), so a packed model's own ``generate`` could differ from the stock one
in a near-tie; and a packed model has no ``nn.Linear`` weights for ``state_dict``, ``.to()`` or
training. The runner costs the packed weights' memory (a GGUF's 4-bit codes: about a sixth of the
float32 weights; a tied embedding stays shared). It is built once per model object and setting,
and again only when the caller's weights change (their storage or version counters). A model off
the CPU, or in a dtype our linears do not take, keeps its own linears, said once on stderr;
``cpu_linear="stock"`` asks for them. The heads are loaded once per model object, heads dir and
setting, however many ``with_heads`` calls name them.

A tree's size (``tree_nodes`` auto, the default) comes from the verify step's time on this
machine, measured once per CPU, thread count, linear setting and model shape and kept in
``STEP_TIMES_FILE`` under the cache (``multitoken.embedded.cache_dir``): later calls, and later
processes, read it instead of timing.
"""

from __future__ import annotations

import copy
import platform
import sys
from pathlib import Path

import torch
from torch import nn

from multitoken.base.errors import UsageError
from multitoken.base.hub import source_gguf, source_sha256
from multitoken.base.tokenizer import load_tokenizer
from multitoken.decoding.engine import generate_batch, prompt_rows
from multitoken.decoding.config import DecodeConfig
from multitoken.embedded import cache_dir, resolve_base
from multitoken.pipeline.sources.assets import load_stats
from multitoken.pipeline.model.backbone import Backbone
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.kernels.cpu_linear import CPU_LINEARS, PACKED_DTYPES, ROWS, STOCK
from multitoken.pipeline.model.model import MultiTokenModel

# transformers' processors that the generation config's sampling fields create and that the
# method applies itself; any other processor (or a user's own) has no counterpart here.
HANDLED = {"TemperatureLogitsWarper", "TopKLogitsWarper", "RepetitionPenaltyLogitsProcessor"}
STEP_TIMES_FILE = "step_times.json"  # under cache_dir(): tree verify-step times per machine and model shape
# The model object's attribute holding what with_heads built on it: the runners (setting ->
# the packed copy), the heads ((heads dir, stats dir, setting) -> (MultiTokenModel, table)) and
# the caller's weights' stamp they were built from. On the model itself, so they go when it goes;
# whichever with_heads call asks (a README-style call builds a new method every time).
ATTACHED = "_multitoken_heads"


def with_heads(heads: str, stats: str | None = None, *, cpu_linear: str = ROWS, **decode) -> callable:
    """A ``custom_generate`` method decoding with the heads in ``heads`` (a heads dir, or
    ``embedded:NAME`` / ``fetched:NAME``) and co-occurrence ``stats`` (same forms; DynaMo / joint
    drafts), on the CPU linears ``cpu_linear`` asks for (``kernels.cpu_linear.CPU_LINEARS``;
    ``stock``: the model's own); ``decode``: other ``DecodeConfig`` fields (mode, tree, tree_nodes, eps_b, ...).
    The method's ``traces`` hold its latest call's per-row traces (forward passes, tokens per forward, accepts)."""
    heads = resolve_base(str(heads))
    stats = resolve_base(str(stats)) if stats is not None else None
    if not (Path(heads) / "heads_config.json").is_file():
        raise UsageError(f"{heads!r} is not a heads dir (no heads_config.json)",
                         "pass a directory made by `multitoken attach` / `multitoken train`, or embedded:NAME for "
                         "heads the package ships (embedded:stories260K-heads, embedded:SmolLM2-135M-Instruct-conditioned)")
    if cpu_linear not in CPU_LINEARS:
        raise UsageError(f"unknown cpu_linear {cpu_linear!r}", f"pass one of {', '.join(CPU_LINEARS)}")

    def multitoken_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=False, streamer=None, **model_kwargs) -> torch.LongTensor:
        extra = sorted({type(p).__name__ for p in logits_processor} - HANDLED)
        if extra:
            raise UsageError(f"with_heads cannot apply {', '.join(extra)}",
                             "drop those generation options, or decode with transformers' own generate")
        mt, table = attached(model, heads, stats, cpu_linear)
        cfg = _decode_config(generation_config, decode, input_ids.shape[1])
        rows = prompt_rows(input_ids, model_kwargs.get("attention_mask"))
        results = generate_batch(mt, rows, cfg, table=table)
        multitoken_generate.traces = [r.trace for r in results]
        return _sequences(input_ids, [r.token_ids for r in results], generation_config)

    multitoken_generate.traces = []
    return multitoken_generate


def attached(model, heads: str, stats: str | None, cpu_linear: str = ROWS):
    """(MultiTokenModel, stats table) for ``model``: built on the first call and kept on the model
    (``ATTACHED``); built again where the model's weights changed since (trained, reloaded)."""
    store = getattr(model, ATTACHED, None)
    stamp = _weights_stamp(model)
    if store is None or store["stamp"] != stamp:
        store = {"stamp": stamp, "runners": {}, "heads": {}}
        setattr(model, ATTACHED, store)
    linear = _linear_for(model, cpu_linear)
    if linear not in store["runners"]:
        store["runners"][linear] = _runner(model, linear)
    if (heads, stats, linear) not in store["heads"]:
        store["heads"][(heads, stats, linear)] = _attach(store["runners"][linear], heads, stats, linear)
    return store["heads"][(heads, stats, linear)]


def _weights_stamp(model) -> tuple:
    """What changes when the caller's weights do: each Parameter's storage and its version counter
    (an in-place update, ``load_state_dict``'s copy, an optimizer step all bump it)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _linear_for(model, asked: str) -> str:
    """The CPU linear setting the runner takes: ``asked``, or stock (said once per model on
    stderr) where our linears cannot run the model: off the CPU, or weights in another dtype."""
    reason = None
    if asked != STOCK and model.device.type != "cpu":
        reason = f"the model is on {model.device}, and our linears are CPU kernels"
    elif asked != STOCK and model.dtype not in PACKED_DTYPES:
        reason = f"its weights are {str(model.dtype).removeprefix('torch.')}, and our CPU linears take float32 / bfloat16"
    if reason is None:
        return asked
    if not getattr(model, _SAID, False):
        setattr(model, _SAID, True)
        print(f"multitoken: with_heads decodes on the model's own linears: {reason} "
              "(cpu_linear=\"stock\" asks for them without this note)", file=sys.stderr)
    return STOCK


_SAID = "_multitoken_said_stock"  # the model's attribute: the stock note was printed for it


def _runner(model, linear: str):
    """The module tree the heads decode on: ``model`` itself for its own linears, else a copy of
    it whose Parameters are new objects over the caller's storage (packing one releases only the
    copy's reference) and whose buffers are the caller's."""
    if linear == STOCK:
        return model
    memo = {id(p): nn.Parameter(p.data, requires_grad=False) for p in model.parameters()}
    memo.update({id(b): b for b in model.buffers()})
    if hasattr(model, ATTACHED):
        memo[id(getattr(model, ATTACHED))] = None  # what with_heads built stays with the caller's model
    return copy.deepcopy(model, memo).eval()


def _attach(runner, heads: str, stats: str | None, linear: str):
    """The heads on ``runner`` (its weights checked against the heads' base), its linears
    prepared as ``linear`` asks now, not on the first step of a decode."""
    name = str(runner.config._name_or_path)
    dtype = str(runner.dtype).removeprefix("torch.")
    backbone = Backbone(runner, load_tokenizer(name), name,
                        BackboneConfig(base=name, dtype=dtype, device=str(runner.device), cpu_linear=linear))
    backbone.source_sha256 = source_sha256(name, {}) if Path(name).is_dir() else None
    backbone.source_gguf = source_gguf(name, {}) if Path(name).is_dir() else None  # its codes read, not searched
    mt = MultiTokenModel.from_pretrained(backbone, heads)
    mt.step_times_store = (cache_dir() / STEP_TIMES_FILE, _machine_and_shape(mt))  # decoding.trees.step_times
    mt.prepare_linears()
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
