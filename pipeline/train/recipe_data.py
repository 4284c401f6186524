"""The recipe's text: prompts cut from a corpus, continued by the base, kept as token shards.

The Medusa-2 / DynaMo recipe: the base continues prompts taken from public text, so the heads
learn what the base itself says next. Every prompt has the same length and every continuation
the same number of new tokens, so a batch needs no padding and every row the same length.

A continuation ends at the base's first EOS (or after the new tokens): the positions after it
are padding, never a target. Shards are the unit of work and of resumption: shard k holds the
continuations of prompts ``[k * rows, (k + 1) * rows)``, each row's draws seeded by (seed, k,
row) (``row_seed``; transformers' path: each batch's by (seed, k, batch)), and is written
atomically (``shard-00007.safetensors``: ``ids`` [n, T] int32, ``valid`` [n, T] uint8, where a
head's loss may look). A killed run re-reads the finished shards and continues with the first
missing one. Only token ids are kept: training recomputes the frozen trunk's states, which on
an accelerator costs less than reading them back from disk.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
import time
from pathlib import Path

import torch

from multitoken.base.errors import DataError, UsageError
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import eos_ids, generate_batch
from multitoken.kernels import cpu_linear
from multitoken.pipeline.model import attention
from multitoken.pipeline.model.backbone import Backbone
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.train import recipe_train as rtrain

SHARD = "shard-{:05d}.safetensors"


# Prompts ----------------------------------------------------------------------------------
def paragraphs(path: Path):
    """A text file's prose blocks: jsonl rows' ``text``, else lines (blank-line blocks for
    text whose lines are verse); markup and headings left out, wikitext's tokenisation undone."""
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        blocks = [json.loads(line).get("text", "") for line in raw.splitlines() if line.strip()]
    else:
        lines = [line.strip() for line in raw.splitlines()]
        filled = [line for line in lines if line]
        if sum(len(line) < 60 for line in filled) > 0.5 * max(len(filled), 1):  # verse: blank-line blocks
            blocks = "\n".join(lines).split("\n\n")
        else:
            blocks = filled
    for block in blocks:
        block = " ".join(block.split())
        if block and not block.startswith(("=", "<")):
            yield _clean_wikitext(block)


def _clean_wikitext(text: str) -> str:
    """Undo wikitext-2's word tokenisation (`` @-@ ``, `` , ``) so prompts read as prose."""
    text = re.sub(r" @(.)@ ", r"\1", text)
    text = re.sub(r" ([,.;:!?)'])", r"\1", text)
    return re.sub(r"\( ", "(", text).replace(" n't", "n't")


def window_prompts(tokenizer, files: list[Path], length: int, stride: int, seed: int,
                   exclude: set[tuple[int, ...]] | None = None) -> torch.Tensor:
    """Distinct ``length``-token windows every ``stride`` tokens inside each paragraph (cut at
    ``<unk>``), none in ``exclude``, shuffled by ``seed`` # [P, length]."""
    def windows():
        for path in files:
            for block in paragraphs(Path(path)):
                for piece in block.split("<unk>"):
                    ids = tokenizer(piece.strip()).input_ids
                    yield from (ids[start:start + length] for start in range(0, len(ids) - length + 1, stride))

    return _distinct_shuffled(windows(), exclude, seed, DataError(
        f"no {length}-token prompt in {', '.join(map(str, files))}", "pass text files with paragraphs of at least that many tokens"))


def sentence_prompts(tokenizer, files: list[Path], length: int, seed: int, min_words: int = 10) -> torch.Tensor:
    """The first ``length`` tokens of each distinct prose sentence (``<unk>``-free, at least
    ``min_words`` words), shuffled by ``seed`` # [P, length]: the held-out prompts heads are
    measured on."""
    def starts():
        for path in files:
            for block in paragraphs(Path(path)):
                for line in re.split(r"(?<=[.!?])\s+", block):
                    if len(line.split()) >= min_words and "<unk>" not in line:
                        ids = tokenizer(line).input_ids[:length]
                        if len(ids) == length:
                            yield ids

    return _distinct_shuffled(starts(), None, seed, DataError(
        f"no sentence of {length}+ tokens in {', '.join(map(str, files))}",
        "pass held-out text with sentences of at least that many tokens"))


def _distinct_shuffled(rows, exclude, seed: int, empty: DataError) -> torch.Tensor:
    """``rows`` (token lists of one length) without repeats or ``exclude``'s, in first-seen order,
    then shuffled by ``seed`` # [P, length]; ``empty`` raised where none is left."""
    seen, kept = set(exclude or ()), []
    for row in rows:
        if tuple(row) not in seen:
            seen.add(tuple(row))
            kept.append(row)
    if not kept:
        raise empty
    order = torch.randperm(len(kept), generator=torch.Generator().manual_seed(seed))
    return torch.tensor(kept, dtype=torch.long)[order]


# Continuations ----------------------------------------------------------------------------
ENGINES = ("multitoken", "transformers")  # who continues the prompts: our batched engine, or transformers' generate
DTYPES = ("auto", "float32", "bfloat16")  # the continuing model's arithmetic (resolve_dtype)
# rows continued at once by default: oneDNN's bf16 matmuls reach AMX's rate past ~128 rows; the
# rows kernel takes 64 per call (gemv_rows.MAX_ROWS), a float32 base's rows past it another matmul
BATCH = {"bfloat16": 256, "float32": 64}
SAMPLED = dict(temperature=0.7, top_k=50)  # the sampled rows' distribution (no repetition penalty), either engine


def resolve_engine(name: str, device: torch.device) -> str:
    """``auto`` -> our engine on the CPU (where our linears run), transformers' ``generate``
    elsewhere (a GPU continues thousands of rows at once, where one batched draw per step beats
    the engine's per-row generators); the others as given."""
    if name != "auto":
        return name
    return "multitoken" if device.type == "cpu" else "transformers"


def resolve_dtype(name: str, backbone) -> str:
    """``auto`` -> bfloat16 on a CPU where training's ``auto`` takes it (bf16 dot products in
    hardware: AVX512-BF16, AMX), where oneDNN's bf16 matmuls of a batch's rows run several times
    faster than float32's, for a float backbone; float32 elsewhere (an emulating CPU gains
    nothing; a GPU's recipe keeps its float32 path). The others as given (bfloat16 refused on a quantized base)."""
    if name == "bfloat16" and backbone.is_quantized:
        raise UsageError("--distill-dtype bfloat16 needs a float base, not a quantized one", "pass --distill-dtype float32")
    if name != "auto":
        return name
    native = backbone.device.type == "cpu" and rtrain.resolve_dtype(backbone.device, "auto") == "bfloat16"
    return "bfloat16" if native and not backbone.is_quantized else "float32"


def bfloat16_copy(backbone) -> Backbone:
    """A copy of ``backbone`` in bfloat16 whose decoding packs its linears in oneDNN's layout
    (``--cpu-linear packed``: each weight reordered once, not at every matmul as torch's
    ``F.linear`` does) and runs a batch's one-token attention in one op (model/attention.py: SDPA's
    values within bf16 rounding, at a fraction of its time); the original is left as it is. Packed
    layers go back to ``nn.Linear`` first (their exact weights)."""
    model = copy.deepcopy(backbone.model)
    cpu_linear.unpack(model)
    model.to(torch.bfloat16)
    if model.config._attn_implementation == "sdpa":
        attention.use(model)
    cfg = backbone.load_config
    if dataclasses.is_dataclass(cfg):
        cfg = dataclasses.replace(cfg, dtype="bfloat16", cpu_linear=cpu_linear.PACKED)
    return Backbone(model, backbone.tokenizer, backbone.name, cfg)


class Continuer:
    """Continues prompts with the base, greedy or sampled (``SAMPLED``), each row to its first
    EOS or ``new_tokens`` (the rest padded, never a target).

    ``multitoken``: our engine's ``ar`` mode (decoding/engine.py), every row of a call in one
    forward pass per token on our CPU linears (the GGUF's own codes), each row seeded by its own
    seed, so a row is the same whatever rows share its call; greedy rows equal transformers'.
    ``transformers``: its ``generate`` on torch's linears, a batch seeded through torch's global
    generator (the recipe's first path, kept to measure against).
    ``dtype`` bfloat16: either engine runs a bfloat16 copy of the base (``bfloat16_copy``): its
    text is the bf16 model's, and a row's logits may round differently with the rows beside it."""

    def __init__(self, backbone, engine: str = "multitoken", dtype: str = "float32"):
        if engine not in ENGINES:
            raise ValueError(f"unknown distillation engine {engine!r}: one of {', '.join(ENGINES)}")
        if dtype not in DTYPES[1:]:
            raise ValueError(f"unknown distillation dtype {dtype!r}: one of {', '.join(DTYPES[1:])}")
        self.dtype = dtype
        if dtype == "bfloat16":
            backbone = bfloat16_copy(backbone)
        self.backbone, self.engine = backbone, engine
        # a base with no draft heads: the engine's ar mode reads head 1 (the base) only
        self.model = MultiTokenModel.attach(backbone, {"head_type": "medusa", "n_future": 1})
        self.eos = sorted(eos_ids(self.model))

    @torch.inference_mode()
    def __call__(self, prompts: torch.Tensor, new_tokens: int, sample: bool, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``prompts`` [B, P] (``seeds``: one per row) -> ids [B, P + new_tokens], valid [B, P + new_tokens]
        (targets from the prompt's last token on, up to a row's first EOS)."""
        if self.engine == "multitoken":
            ids = self._engine(prompts, new_tokens, sample, seeds)
        else:
            ids = self._transformers(prompts, new_tokens, sample, seeds[0])
        valid = torch.ones_like(ids, dtype=torch.bool)
        if self.eos:
            ended = torch.isin(ids, torch.tensor(self.eos)) & (torch.arange(ids.shape[1]) >= prompts.shape[1])
            valid &= ended.cumsum(1) == 0
        valid[:, : prompts.shape[1] - 1] = False  # the public text is not what the base says
        return ids, valid

    def _pad(self) -> int:
        return self.eos[0] if self.eos else 0

    def _engine(self, prompts: torch.Tensor, new_tokens: int, sample: bool, seeds: list[int]) -> torch.Tensor:
        picks = dict(greedy=True) if not sample else dict(SAMPLED, repetition_penalty=1.0)
        cfg = DecodeConfig(mode="ar", max_new_tokens=new_tokens, stop_at_eos=True, **picks)
        rows = generate_batch(self.model, prompts.tolist(), cfg, seeds=seeds)
        out = torch.full((len(rows), prompts.shape[1] + new_tokens), self._pad(), dtype=torch.long)  # [B, T]
        out[:, : prompts.shape[1]] = prompts
        for b, row in enumerate(rows):
            out[b, prompts.shape[1]: prompts.shape[1] + len(row.token_ids)] = torch.tensor(row.token_ids, dtype=torch.long)
        return out

    def _transformers(self, prompts: torch.Tensor, new_tokens: int, sample: bool, seed: int) -> torch.Tensor:
        bb = self.backbone
        torch.manual_seed(seed)
        x = prompts.to(bb.device)
        options = dict(do_sample=True, top_p=1.0, **SAMPLED) if sample else dict(do_sample=False)
        ids = bb.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, pad_token_id=self._pad(),
                                eos_token_id=self.eos or None, **options).cpu()  # [B, <= T]: every row may end early
        out = torch.full((len(prompts), prompts.shape[1] + new_tokens), self._pad(), dtype=torch.long)
        out[:, : ids.shape[1]] = ids
        return out


def row_seed(seed: int, shard: int, row: int) -> int:
    """Row ``row`` of shard ``shard``'s own seed (below 2**63): the same row gets the same draws
    whatever call it is decoded in."""
    digest = hashlib.sha256(f"{seed}/{shard}/{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def write_shard(path: Path, ids: torch.Tensor, valid: torch.Tensor, meta: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({"ids": ids.to(torch.int32).contiguous(), "valid": valid.to(torch.uint8).contiguous()}, str(tmp),
              metadata={k: str(v) for k, v in meta.items()})
    os.replace(tmp, path)


def read_shards(folder: Path) -> dict[str, torch.Tensor]:
    """Every finished shard of ``folder``, in order: ids [N, T] int64, valid [N, T] bool."""
    from safetensors.torch import load_file

    parts = [load_file(str(p)) for p in sorted(folder.glob("shard-*.safetensors"))]
    if not parts:
        raise DataError(f"{folder} holds no shard", "run the distillation stage first")
    return {"ids": torch.cat([p["ids"] for p in parts]).long(), "valid": torch.cat([p["valid"] for p in parts]).bool()}


def distill_shards(continuer: Continuer, prompts: torch.Tensor, folder: Path, new_tokens: int, rows: int, batch: int,
                   sample_every: int, seed: int, seconds: float | None = None, rank: int = 0, world: int = 1,
                   log=print) -> dict:
    """Continue ``prompts`` into shards of ``rows`` rows under ``folder`` (every
    ``sample_every``-th batch sampled, 0: all greedy), skipping finished shards; stop early
    after ``seconds``. Under torchrun rank r makes shards r, r + world, ... Returns the stage's
    record (its wall and process CPU seconds: on a shared machine the latter is the stable one)."""
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = -(-len(prompts) // rows)
    started, cpu, made, tokens = time.time(), time.process_time(), 0, 0
    for k in range(rank, n_shards, world):
        path = folder / SHARD.format(k)
        if path.is_file():
            continue
        if seconds is not None and time.time() - started > seconds:
            log(f"distill: time budget reached after {made} new shard(s)")
            break
        part = prompts[k * rows:(k + 1) * rows]
        ids, valid, shown = [], [], time.time()
        for j, at in enumerate(range(0, len(part), batch)):
            sample = sample_every > 0 and j % sample_every == sample_every - 1
            seeds = [row_seed(seed, k, r) for r in range(at, at + len(part[at:at + batch]))]
            if continuer.engine == "transformers":  # one seed per batch, through torch's global generator
                seeds = [seed * 100_003 + k * 1009 + j]
            got = continuer(part[at:at + batch], new_tokens, sample, seeds)
            ids.append(got[0])
            valid.append(got[1])
            if time.time() - shown > 10:  # a line every ~10 s inside a long shard
                shown = time.time()
                log(f"distill {folder.name}: shard {k + 1}/{n_shards}, {at + len(got[0]):,}/{len(part):,} rows")
        write_shard(path, torch.cat(ids), torch.cat(valid), {"shard": k, "seed": seed, "new_tokens": new_tokens,
                                                             "engine": continuer.engine, "dtype": continuer.dtype})
        made += 1
        tokens += len(part) * new_tokens
        rate = tokens / max(time.time() - started, 1e-9)
        left = sum(1 for i in range(k + world, n_shards, world) if not (folder / SHARD.format(i)).is_file())
        log(f"distill {folder.name}: shard {k + 1}/{n_shards}, {rate:,.0f} new tokens/s, "
            f"ETA {left * rows * new_tokens / max(rate, 1e-9):.0f} s")
    done = sorted(folder.glob("shard-*.safetensors"))
    return {"shards": len(done), "of": n_shards, "new_tokens_this_run": tokens, "seconds": round(time.time() - started, 1),
            "cpu_seconds": round(time.process_time() - cpu, 2), "engine": continuer.engine, "dtype": continuer.dtype}
