"""Bad-input cases, part 4: trust (issue 46). Code planted in a checkpoint never runs and is
never offered to run (no prompt on stdin); ``bad_input_cases.py`` adds them to ``CASES``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from multitoken.embedded import EMBEDDED_DIR

from .bad_output_cases import Case


def _planted_module(folder: Path, d: Path, body: str) -> None:
    """``folder/evil.py``: writes ``d/PWNED`` when imported, then defines ``body``."""
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(d / 'PWNED')!r}).write_text('ran')\n{body}")


def _base_copy(d: Path, skip: str) -> Path:
    base = d / "base"
    base.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        if name != skip:
            shutil.copy(EMBEDDED_DIR / "stories260K" / name, base / name)
    return base


def base_custom_model_code(w, d):  # was: "Do you wish to run the custom code? [y/N]" on stdin
    base = _base_copy(d, "config.json")
    config = json.loads((EMBEDDED_DIR / "stories260K" / "config.json").read_text())
    config.update(model_type="evilmodel", architectures=["EvilForCausalLM"],
                  auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"})
    (base / "config.json").write_text(json.dumps(config))
    _planted_module(base, d, "from transformers import LlamaConfig\nclass EvilConfig(LlamaConfig):\n    model_type = 'evilmodel'\n")
    return Case(["generate", "Once", "--base", base, "--max-new-tokens", "2"], 1,
                "model_type 'evilmodel' is defined by code in the checkpoint (evil.py, auto_map): refused, not run")


def base_custom_tokenizer_code(w, d):  # was: the prompt, then a three-line error
    base = _base_copy(d, "tokenizer_config.json")
    config = json.loads((EMBEDDED_DIR / "stories260K" / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    _planted_module(base, d, "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    return Case(["generate", "Once", "--base", base, "--max-new-tokens", "2"], 1,
                "needs code shipped with the checkpoint to load (custom model or tokenizer classes): refused, not run")


TRUST_CASES = [base_custom_model_code, base_custom_tokenizer_code]
