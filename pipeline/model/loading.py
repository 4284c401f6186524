"""Load a base model as a ``Backbone``: from a Hub id, a folder, a GGUF file, ``fetched:`` or
``embedded:``, in float or 4/8-bit, with a fresh or saved LoRA adapter. Everything the user can
get wrong (device, path, custom code, damaged weights, a quantization the device cannot run) is
checked before a weight is read, and said in one line.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from multitoken.base import collector
from multitoken.embedded import BASE_FORMS, default_base, portable_base, resolve_base
from multitoken.base.errors import CheckpointError, UsageError
from multitoken.base.hub import check_no_custom_code, custom_code_error, locate, source_gguf, source_sha256
from multitoken.base.dtypes import DTYPES, resolve_dtype
from multitoken.base.finite import check_finite
from multitoken.base.progress import status
from multitoken.base.threads import set_threads, threads_field
from multitoken.base.weight_files import check_base_dir, check_lora_dir
from multitoken.base.tokenizer import load_tokenizer
from multitoken.base.quiet import quiet_loading
from multitoken.kernels.cpu_linear import CPU_LINEARS, ROWS
from multitoken.pipeline.model.backbone import ARCHITECTURES, ArchSpec, Backbone, check_supported
from multitoken.pipeline.model.quantization import checked_quantized_layers


QUANTIZATIONS = ("8bit", "4bit")


@dataclass
class BackboneConfig:
    """How to load the base model. Drives the ``--base/--dtype/--device/--quantization`` flags."""

    base: str = field(
        default_factory=default_base,
        metadata={"help": f"the base model: {BASE_FORMS} (default: embedded:stories260K)"},
    )
    dtype: str = field(default="float32", metadata={"help": "weights dtype", "choices": tuple(DTYPES)})
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu, cuda, cuda:1"})
    quantization: str | None = field(
        default=None,
        metadata={"help": "load the backbone in 8-bit or 4-bit (bitsandbytes)", "choices": QUANTIZATIONS},
    )
    threads: int | None = threads_field()  # applied by load_backbone, process-wide
    cpu_linear: str = field(default=ROWS, metadata={
        "help": "CPU linears when decoding: rows (a multi-row kernel compiled here; packed where it cannot be built), "
                "rows-q8 (the same, with Q4_1 / Q8_0 GGUF codes read against int8 activations as llama.cpp reads them: "
                "faster, not exact), rows-f32 (the same on float32 blocks, GGUF codes not kept: to measure them), packed (oneDNN) or "
                "stock (torch's F.linear); details: docs/decoding.md#cpu-linears",
        "choices": CPU_LINEARS})


@dataclass
class LoraSpec:
    """LoRA on the backbone (peft). ``target_modules=None`` takes the architecture's q/k/v."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None


def read_config(base: str, hub_kwargs: dict | None = None):
    """The checkpoint's transformers config (``base`` and ``hub_kwargs`` from ``hub.locate``)."""
    from transformers import AutoConfig

    if Path(base).is_dir():
        check_no_custom_code(Path(base), tuple(sorted(ARCHITECTURES)))
    try:
        return AutoConfig.from_pretrained(base, trust_remote_code=False, **(hub_kwargs or {}))
    except (OSError, ValueError, struct.error, EOFError) as err:  # a damaged GGUF header: struct / EOF errors
        raise _load_error(base, err, (hub_kwargs or {}).get("gguf_file")) from err


# Device types a model can run on; each has torch.<type>.is_available() and device_count().
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def check_device(name: str) -> torch.device:
    """``name`` as a torch device that exists on this machine, else a UsageError saying why."""
    fix = "use --device cpu, or cuda / cuda:N / mps on a machine that has one"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"unknown device {name!r}", fix) from None
    if device.type == "cpu":
        if device.index not in (None, 0):  # torch takes cpu:5 and runs on the one CPU device
            raise UsageError(f"device {name!r} does not exist: torch has one cpu device, which runs on all the "
                             "machine's cores (set how many with --threads)", "use --device cpu")
        return device
    if device.type not in DEVICE_TYPES:
        raise UsageError(f"device {name!r} cannot run a model", fix)
    backend = getattr(torch, device.type, None)
    if backend is None or not backend.is_available():
        raise UsageError(f"device {name!r} is not available: this machine has no {device.type} device "
                         f"(or this torch build has no {device.type} support)", fix)
    count = backend.device_count()
    if device.index is not None and device.index >= count:
        raise UsageError(f"device {name!r} does not exist: this machine has {count} {device.type} device(s)",
                         f"use --device {device.type}:N with 0 <= N < {count}")
    return device


def _load_error(base: str, err: Exception, gguf: str | None = None) -> CheckpointError:
    refused = custom_code_error(base, err)
    if refused is not None:
        return refused
    if gguf is not None:  # transformers reads a GGUF as a folder plus a file name: name the file
        return CheckpointError(f"{str(Path(base) / gguf)!r} is not a GGUF file transformers can read "
                               f"({str(err).splitlines()[0] if str(err) else type(err).__name__})",
                               "pass a complete GGUF file (llama or gpt_neox), or a checkpoint folder")
    if Path(base).expanduser().exists():
        return CheckpointError(
            f"could not load a model from {base!r}: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
            "the directory needs a transformers config.json and *.safetensors weights",
        )
    return CheckpointError(
        f"{base!r} is neither a local directory nor a reachable Hugging Face Hub model ({type(err).__name__})",
        "check the path or Hub id; without network access, download the checkpoint first and pass its directory",
    )


def _quantization_config(quantization: str, dtype: torch.dtype, skip_modules: list[str] | None = None):
    """bitsandbytes' config of a quantization ``_quantized_layers`` accepted."""
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip_modules)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                              llm_int8_skip_modules=skip_modules)


def _quantized_layers(model_config, config: "BackboneConfig"):
    """The Linear layers bitsandbytes can take on ``config.device``; None without quantization."""
    if config.quantization is None:
        return None
    if config.quantization not in QUANTIZATIONS:
        raise UsageError(f"unknown quantization {config.quantization!r}",
                         f"use one of {', '.join(QUANTIZATIONS)}, or None (omit --quantization) for float weights")
    return checked_quantized_layers(model_config, config.quantization, config.device, str(config.base))


def load_backbone(
    config: BackboneConfig | None = None,
    *,
    lora: LoraSpec | None = None,
    lora_adapter: str | None = None,
    trainable_lora: bool = False,
) -> Backbone:
    """Load the base model named by ``config.base`` (Hub id or local dir).

    ``lora`` wraps the model with a fresh peft LoRA adapter; ``lora_adapter`` loads a saved
    one (peft's own format). The backbone is returned in eval mode with every parameter frozen
    except LoRA ones when ``trainable_lora`` is set; freezing policy lives here, not in heads.
    """
    config = config or BackboneConfig()
    # Everything the user can get wrong is checked before a weight is read, and the base
    # located before transformers is imported (a second): a mistyped path or an unreachable
    # Hub fails at once.
    check_device(config.device)
    set_threads(config.threads)
    dtype = resolve_dtype(config.dtype)
    base, hub_kwargs = locate(resolve_base(str(config.base)))
    status(f"loading {portable_base(str(config.base))}")
    from transformers import AutoModelForCausalLM

    if Path(base).is_dir():
        check_base_dir(Path(base))  # pickles refused, safetensors headers checked, before transformers reads
    model_config = read_config(base, hub_kwargs)
    spec = check_supported(model_config.model_type)
    qlayers = _quantized_layers(model_config, config)
    kwargs: dict = {"dtype": dtype, **hub_kwargs}
    if hub_kwargs.get("local_files_only"):  # transformers looks for a peft adapter on the Hub without it,
        kwargs["adapter_kwargs"] = {"local_files_only": True}  # through huggingface_hub's retries
    if qlayers is not None:
        quant = _quantization_config(config.quantization, dtype, qlayers.skip_modules())
        kwargs.update(quantization_config=quant, device_map={"": config.device})
    try:
        with quiet_loading():  # no "Loading weights" bar or load notices; the caller's settings restored after
            model = AutoModelForCausalLM.from_pretrained(base, config=model_config, trust_remote_code=False, **kwargs)
    except (OSError, ValueError, struct.error, EOFError) as err:
        raise _load_error(base, err, hub_kwargs.get("gguf_file")) from err
    if qlayers is None:
        model = model.to(config.device)
    if torch.device(config.device).type != "meta":  # a damaged checkpoint fails here, not as garbage text
        check_finite(model.named_parameters(), f"the base {base!r}", "the checkpoint is damaged: restore it, or fetch / download it again")
    model = _attach_lora(model, spec, lora, lora_adapter, trainable_lora)
    model.eval()
    name = str(Path(base) / hub_kwargs["gguf_file"]) if "gguf_file" in hub_kwargs else base
    backbone = Backbone(model, load_tokenizer(name), name, config)
    backbone.source_sha256 = source_sha256(base, hub_kwargs)
    backbone.source_gguf = source_gguf(base, hub_kwargs)
    if qlayers is not None:
        backbone.float_layers = dict(qlayers.left_float)
    collector.model_loaded()  # the CLI's start-up ends here (base/collector.py)
    return backbone


def _attach_lora(model, spec: ArchSpec, lora: LoraSpec | None, adapter: str | None, trainable: bool):
    for p in model.parameters():
        p.requires_grad_(False)
    if lora is None and adapter is None:
        return model
    if lora is not None and adapter is not None:
        raise UsageError("both a new LoRA spec and a saved LoRA adapter were given", "pass only one of them")
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter is not None:
        check_lora_dir(Path(adapter))  # config schema, safetensors only, header and values
        try:
            model = PeftModel.from_pretrained(model, adapter, is_trainable=trainable)
        except (OSError, ValueError, TypeError, KeyError, RuntimeError) as err:  # shapes or modules that do not fit
            raise CheckpointError(f"could not load the LoRA adapter in {adapter!r}: {str(err).splitlines()[0][:200]}",
                                  "the heads' LoRA does not fit this base: load them onto the base they were trained on") from err
    else:
        targets = list(lora.target_modules or spec.lora_targets)
        cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
        model = get_peft_model(model, cfg)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable and "lora_" in name)
    return model
