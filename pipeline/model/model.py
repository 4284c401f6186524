"""``MultiTokenModel``: a backbone plus a head adapter, predicting tokens t+1..t+n per position.

One backbone pass runs the trunk (layers[:-1]) and the original final layer (head 1, the base
model's own next-token path); the adapter then produces heads 2..n from it. With a frozen
backbone the pass runs without autograd. Losses are computed head by head over chunks of
tokens, so [B, T, n, V] logits never exist at once.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from multitoken.adapters.base import DEFAULT_CHUNK, Features, LossOutput
from multitoken.adapters.registry import build_head, make_config

from multitoken.kernels import cpu_linear, gguf_file
from multitoken.pipeline.model.backbone import Backbone
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.draft_vocab import DraftUnembedding, read_ranking, resolve_size
from multitoken.pipeline.model.heads_io import load_heads, save_heads
from multitoken.pipeline.runtime.incremental import new_caches, next_ids, step

__all__ = ["MultiTokenModel", "LossOutput"]


class MultiTokenModel(nn.Module):
    """Backbone + head adapter.

    ``base_model`` (the backbone's possibly-peft model) is a registered submodule so that
    ``.parameters()`` / DDP see trainable LoRA weights; frozen base weights are ignored by
    optimizers and never saved by ``save_heads``. ``heads`` holds only the new head weights.
    """

    heads_dir: str | None = None  # set when loaded from a heads dir (decoding reads its per-rank accuracies)

    def __init__(self, backbone: Backbone, heads: nn.Module, loss_chunk: int = DEFAULT_CHUNK):
        super().__init__()
        self.backbone = backbone
        self.base_model = backbone.model
        self.heads = heads
        self.loss_chunk = loss_chunk
        self.base_model.eval()

    # Construction -----------------------------------------------------------------------
    @classmethod
    def attach(cls, backbone: Backbone, head_config, **kwargs) -> "MultiTokenModel":
        """New (untrained) heads of ``head_config`` on ``backbone``. ``head_config`` may be a
        head config dataclass or a dict like ``{"head_type": "cp", "n_future": 3, "rank": 4}``."""
        if isinstance(head_config, dict):
            options = dict(head_config)
            head_config = make_config(options.pop("head_type"), **options)
        return cls(backbone, cls.new_heads(head_config, backbone), **kwargs)

    @staticmethod
    def new_heads(head_config, backbone: Backbone) -> nn.Module:
        """The adapter of ``head_config`` built from ``backbone``'s stock modules (a layer head
        copies the final layer's dense weights; a decoding run may have packed them)."""
        cpu_linear.unpack(backbone.model)
        return build_head(head_config, backbone)

    @classmethod
    def from_pretrained(
        cls, base: str | BackboneConfig | Backbone | None, heads_dir: str | Path, *,
        quantization: str | None = None, dtype: str | None = None, device: str | None = None,
        trainable_lora: bool = False, **kwargs,
    ) -> "MultiTokenModel":
        """Load saved heads (and their LoRA adapter, if any) onto ``base``: a Hub id or dir, a
        ``BackboneConfig``, an already loaded ``Backbone``, or None for the base recorded in
        the heads dir. Fails clearly on a different base, a corrupt file or an unknown type."""
        return load_heads(cls, base, heads_dir, quantization=quantization, dtype=dtype, device=device,
                          trainable_lora=trainable_lora, **kwargs)

    def save_heads(self, out_dir: str | Path, extra: dict[str, str] | None = None, command: str = "save_heads") -> Path:
        """Write heads.safetensors + heads_config.json (+ peft's adapter files in ``lora/``, and
        ``extra`` {file name: text}) all or nothing, recording them (``command`` wrote them). The
        weights are read from the stock modules (a packed layer's state_dict holds none)."""
        cpu_linear.unpack(self)
        return save_heads(self, out_dir, extra, command)

    # Introspection ----------------------------------------------------------------------
    @property
    def config(self):
        return self.heads.config

    @property
    def n_future(self) -> int:
        return self.heads.n_future

    @property
    def has_lora(self) -> bool:
        return hasattr(self.base_model, "peft_config")

    def head_parameters(self) -> list[nn.Parameter]:
        """All trainable parameters of the new heads (copies and random-init alike)."""
        return [p for p in self.heads.parameters() if p.requires_grad]

    def head_parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """``{"copied": [...], "new": [...]}``: copy-initialised head weights (DynaMo: LR_B)
        and freshly initialised ones (DynaMo: LR_M)."""
        copied = self.heads.copied_parameter_names()
        groups: dict[str, list[nn.Parameter]] = {"copied": [], "new": []}
        for name, p in self.heads.named_parameters():
            if p.requires_grad:
                groups["copied" if name in copied else "new"].append(p)
        return groups

    def base_head_parameters(self) -> list[nn.Parameter]:
        """Head 1's own weights: the original final layer and final norm (base weights, frozen
        unless the trainer unfreezes them, e.g. for DynaMo's LR_B)."""
        lora = {id(p) for p in self.lora_parameters()}
        params = list(self.backbone.layers[-1].parameters()) + list(self.backbone.final_norm.parameters())
        return [p for p in params if id(p) not in lora]

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.base_model.named_parameters() if "lora_" in n]

    def train(self, mode: bool = True) -> "MultiTokenModel":
        # The base keeps eval-mode behaviour (no dropout) so head 1 stays the base model's path.
        # Training runs on the stock linears (packed ones are for decoding: no weight gradients).
        if mode:
            cpu_linear.unpack(self)
            self.__dict__.pop("_draft_unembeds", None)  # copies of the unembedding: training may change it
        self.training = mode
        self.heads.train(mode)
        self.base_model.eval()
        return self

    # Forward ----------------------------------------------------------------------------
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 next_known: int | None = None) -> Features:
        """One backbone pass # [B, T] -> Features ([B, T, H] each). Autograd only where a
        backbone weight is trainable (the trunk and the final layer are checked separately).
        ``next_known``: for heads that read token t+1 (``needs_next_tokens``), how many leading
        positions take it from the text (teacher forcing); the others take the base's argmax, as
        decoding does for tokens not yet settled (default: every position but the last)."""
        bb = self.backbone
        grad = torch.is_grad_enabled()
        trunk_grad = grad and _any_grad(bb.embeddings, *bb.layers[:-1])
        with torch.set_grad_enabled(trunk_grad):
            trunk = bb.run_trunk(input_ids, attention_mask, collect=self.heads.needs_layer_states)
        with torch.set_grad_enabled(trunk_grad or (grad and _any_grad(bb.layers[-1], bb.final_norm))):
            base = bb.final_norm(bb.run_layer(bb.layers[-1], trunk.hidden, trunk.ctx))  # [B, T, H]
        feats = Features(trunk=trunk.hidden, base=base, layer_states=trunk.layer_states, ctx=trunk.ctx)
        if self.heads.needs_next_tokens:
            feats.next_ids = self.next_tokens(input_ids, base, next_known)
        return feats

    @torch.no_grad()
    def next_tokens(self, input_ids: torch.Tensor, base: torch.Tensor, next_known: int | None = None) -> torch.Tensor:
        """Token t+1 after each position, for heads that read it # [B, T]: the text's own for
        the first ``next_known`` positions (default: all but the last), the argmax of the base
        hidden states ``base`` [B, T, H] after them (``incremental.next_ids``)."""
        known = input_ids.shape[1] - 1 if next_known is None else min(next_known, input_ids.shape[1] - 1)
        return next_ids(input_ids, self.backbone.logits(base[:, known:]).argmax(-1), known)

    def compute_loss(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     skip_constant: bool = False) -> LossOutput:
        """Per-head mean cross-entropy (head i predicts token t+i), aux loss and metrics.
        ``skip_constant``: leave out heads no gradient reaches (see ``HeadAdapter.loss``)."""
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        feats = self.features(input_ids, attention_mask)
        return self.heads.loss(feats, input_ids, valid, self.loss_chunk, skip_constant=skip_constant)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                skip_constant: bool = False) -> LossOutput:
        # forward == compute_loss so DDP(model)(ids) syncs gradients of every trainable weight.
        return self.compute_loss(input_ids, attention_mask, skip_constant=skip_constant)

    @torch.no_grad()
    def head_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, last_only: bool = True,
        next_known: int | None = None,
    ) -> list[torch.Tensor]:
        """Log-distributions for tokens t+1..t+n: a list of n tensors [B, P, V] (P = 1 with
        ``last_only``, else T). Entry 0 is the base model's own next-token distribution.
        ``next_known``: see ``features``."""
        feats = self.features(input_ids, attention_mask, next_known)
        return [self.heads.log_probs(i, feats, last_only=last_only) for i in range(self.n_future)]

    # Incremental decoding (see incremental.py) --------------------------------------------
    def new_caches(self, draft_vocab: int | None = None):
        """Empty KV caches for one decoding run: the backbone's plus one per head layer. The CPU
        linears are as ``prepare_linears`` last set them (decoding calls it where a run starts).
        ``draft_vocab``: how many of the heads' most frequent tokens their drafts score
        (``draft_vocab.py``; 0: the whole vocabulary; None: the size the heads dir records, else
        the whole vocabulary)."""
        return new_caches(self, self.draft_unembedding(draft_vocab))

    def draft_unembedding(self, size: int | None = None) -> DraftUnembedding | None:
        """The layer heads' unembedding over their ``size`` most frequent tokens (None: the
        whole vocabulary, or a head type whose drafts do not go through the shared unembedding),
        built once per size and kernel choice and reused by every run."""
        if not self.heads.num_head_layers or getattr(self.heads, "first_layer_head", 1) < 1:
            return None  # one-position heads (Medusa, CP) unembed inside their adapter; WHS "all heads" verifies with a head layer
        bb = self.backbone
        if "_ranking" not in self.__dict__:  # read once, at the first decoding run (no I/O at load)
            self._ranking = read_ranking(self.heads_dir, bb.vocab_size)
        size = resolve_size(size, self._ranking, bb.vocab_size)
        if not size:
            return None
        built = self.__dict__.setdefault("_draft_unembeds", {})
        packed = cpu_linear.format_of(bb.unembedding)
        key = (size, type(bb.unembedding).__name__, packed, str(bb.device))  # a repack or a move rebuilds it
        if key not in built:
            ids = torch.tensor(self._ranking["tokens"][:size], dtype=torch.long)
            built[key] = draft = DraftUnembedding(bb.unembedding, ids.sort().values, bb.vocab_size)
            if packed is not None:  # the decoding linears are packed: this one too, as they were
                cpu_linear.pack(draft, self._cpu_linear(), self._gguf_codes())
        return built[key]

    def prepare_linears(self) -> int:
        """The one place the CPU linear setting (``--cpu-linear``, ``BackboneConfig.cpu_linear``)
        is applied: the compiled kernel's formats (the default; oneDNN's layout where it cannot be
        built), oneDNN's, or stock; returns how many linears are packed. Decoding calls it where a
        run starts; a model already prepared for the setting is left as it is (docs/kernels.md)."""
        return cpu_linear.prepare(self, self._cpu_linear(), self._gguf_codes())

    def _gguf_codes(self):
        """The codes of the base's GGUF, where it has one on disk (else its floats are searched)."""
        return gguf_file.codes_of(self.backbone.source_gguf)

    def _cpu_linear(self) -> str:
        return getattr(self.backbone.load_config, "cpu_linear", cpu_linear.ROWS)

    def step(self, new_ids: torch.Tensor, caches, heads_upto: int | None = None, read_from: int = 0,
             lengths: list[int] | None = None, attend: torch.Tensor | None = None,
             offsets: torch.Tensor | None = None, clock=None, defer_heads: bool = False):
        """Run only ``new_ids`` [B, T] after the cached positions, extending every cache; the
        returned ``StepOutput`` gives per-head log-probs at the new positions on demand.
        ``caches.keep(start, slots)`` keeps each row's accepted slots of the step, ``keep_rows``
        the rows still decoding; ``heads_upto`` skips
        the layers of heads a run never reads; ``read_from`` skips the logits of earlier
        positions; ``lengths``: real tokens per row, right-aligned in ``new_ids`` (batched rows;
        None: all); ``attend`` / ``offsets``: an explicit mask among the new tokens and their
        positions (a candidate tree: [T, T] / [T] for batch size 1, [B, T, T] / [B, T] per row);
        ``clock``: what the output's lazy unembeddings time themselves with (model time);
        ``defer_heads``: heads that read token t+1 wait for ``StepOutput.condition`` to name it."""
        return step(self, new_ids, caches, heads_upto, read_from, lengths, attend, offsets, clock, defer_heads)


def _any_grad(*modules: nn.Module) -> bool:
    return any(p.requires_grad for m in modules for p in m.parameters())


def attach(base: str | BackboneConfig, head_config, **backbone_kwargs) -> MultiTokenModel:
    """Convenience: load ``base`` and attach new heads."""
    config = base if isinstance(base, BackboneConfig) else BackboneConfig(base=str(base))
    return MultiTokenModel.attach(load_backbone(config, **backbone_kwargs), head_config)
