"""Bad-input cases, part 4: trust (issue 46). Code planted in a checkpoint never runs and is
never offered to run (no prompt on stdin); ``bad_input_cases.py`` adds them to ``CASES``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from multitoken.base.cores import usable_cores
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


def base_known_type_with_auto_map(w, d):  # transformers' own Llama classes load it; evil.py never runs
    base = _base_copy(d, "config.json")
    config = json.loads((EMBEDDED_DIR / "stories260K" / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"}
    (base / "config.json").write_text(json.dumps(config))
    _planted_module(base, d, "from transformers import LlamaConfig\nclass EvilConfig(LlamaConfig):\n    pass\n")
    return Case(["generate", "Once", "--base", base, "--max-new-tokens", "2"], 0, "tokens/forward")


def _draft_vocab_case(record: dict, message: str):
    def case(w, d):
        h = Path(shutil.copytree(w["heads"], d / "H"))
        (h / "draft_vocab.json").write_text(json.dumps(record))
        return Case(["generate", "Once", "--heads", h, "--max-new-tokens", "2"], 1, message, [h / "draft_vocab.json"])
    return case


def _refused(args: list, message: str, code: int = 2):
    def case(w, d):
        resolved = [w[a[1:]] if str(a).startswith("@") and a[1:] in w else d / a[1:] if str(a).startswith("@") else a for a in args]
        return Case(resolved, code, message, [_note(d / "notes.txt")], cwd=d)
    return case


def _note(path: Path) -> Path:
    path.write_text("the user's own notes\n")
    return path


TRUST_CASES = [base_custom_model_code, base_custom_tokenizer_code, base_known_type_with_auto_map]
OUTSIDE = "NAME takes the name of one of"
TRUST_TABLE = {
    # embedded:NAME / fetched:NAME name one folder of their root, as --heads embedded:NAME does
    "base_embedded_outside": _refused(["generate", "Once", "--base", "embedded:../../..", "--max-new-tokens", "2"],
                                      f"'embedded:../../..': embedded:{OUTSIDE} the package's own folders, not a path"),
    "base_fetched_outside": _refused(["generate", "Once", "--base", "fetched:../../..", "--max-new-tokens", "2"],
                                     f"'fetched:../../..': fetched:{OUTSIDE} the fetched models in"),
    "base_fetched_absolute": _refused(["generate", "Once", "--base", "fetched:/etc", "--max-new-tokens", "2"],
                                      f"'fetched:/etc': fetched:{OUTSIDE}"),
    "base_embedded_unknown": _refused(["generate", "Once", "--base", "embedded:nothere", "--max-new-tokens", "2"],
                                      "embedded:nothere: the package ships no folder of that name"),
    "stats_embedded_outside": _refused(["generate", "Once", "--mode", "dynamic", "--stats", "embedded:..", "--max-new-tokens", "2"],
                                       "the package ships no folder of that name"),
    # draft_vocab.json beside the heads: checked whole (size 1.5 was truncated to 1)
    "draft_vocab_size_float": _draft_vocab_case({"tokens": [5, 6, 7], "size": 1.5}, "draft_vocab.json: size must be an integer >= 0, got 1.5"),
    "draft_vocab_id_past_the_vocab": _draft_vocab_case({"tokens": [5, 600], "size": 2},
                                                       "draft_vocab.json: token id 600 is outside the base's vocabulary [0, 512)"),
    "draft_vocab_duplicate_ids": _draft_vocab_case({"tokens": [5, 6, 5], "size": 2}, "draft_vocab.json: tokens lists 1 id(s) twice"),
    # options checked against what the machine and the heads can do
    "attach_n_1": _refused(["attach", "--n", "1", "--out", "@out"], "--head replicated --n 1 gives heads with 0 trainable parameters"),
    "generate_device_cpu_5": _refused(["generate", "Once", "--device", "cpu:5", "--max-new-tokens", "2"],
                                      "device 'cpu:5' does not exist: torch has one cpu device"),
    "stats_build_num_proc_past_the_cores": _refused(  # one task more than the cores: cheap, and past them
        ["stats", "build", "--data", "@corpus", "--out", "@S", "--order", "2", "--num-proc", str(usable_cores() + 1)],
        f"warning: --num-proc {usable_cores() + 1} is more than the {usable_cores()} cores this process may use: "
        f"using {usable_cores()} worker processes for its {usable_cores() + 1} tasks", code=0),
}
