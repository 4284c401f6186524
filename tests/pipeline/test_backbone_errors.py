"""Bad ``--base/--device/--quantization`` values from the command line: one error (its line and
its fix line), no traceback, non-zero exit, before any weight is read; and the quantization
split that keeps in float the layers no kernel of this CPU takes.

Every command line of this module runs once, in its own process forked from one that imported
the CLI (``tests/cli/cli_zygote.py``), from the ``runs`` fixture; each test reads its outcome."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from multitoken.pipeline.model.quantization import fits_4bit, packed_cpu_4bit, quantized_layers

from ..cli.cli_helpers import run_forked

# The Hub as seen from a machine without network: nothing listens on port 9 of this machine, so
# the probe is refused at once, on every machine, with or without network.
OFFLINE = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
PROBE = ["127.0.0.1", 9]  # the one connect the Hub's probe makes
MISTYPED = ["./no/such/model", "~/no-such-model-dir", "/no/such/model", "runs/modle"]
FETCHED_DAMAGE = {"changed": "its sha256 differs", "grown": "changed since it was fetched", "removed": "is missing"}
GGUF_TAILS = {"empty": b"", "garbage": bytes(range(256)) * 64}


@dataclass
class Run:
    args: list
    cwd: Path | None = None
    env: dict | None = None


def _generate(*args, prompt: str = "Once upon a time", **where) -> Run:
    return Run(["generate", prompt, "--max-new-tokens", "4", *args], **where)


def _unavailable_devices() -> list[str]:
    """Devices this machine lacks: cuda / mps when absent, else an index past the last one."""
    cuda = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    mps = "mps:1" if torch.backends.mps.is_available() else "mps"
    return [cuda, mps, "cuda:7" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count() + 6}"]


def _hub_cache(root: Path, tiny_llama_dir: Path) -> Path:
    """The cache layout huggingface_hub writes, holding someone/tiny-llama: refs/main names the
    snapshot holding the files."""
    repo = root / "models--someone--tiny-llama"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return root


def _nan_base(tiny_llama_dir: Path, base: Path) -> Path:
    """The tiny Llama with one NaN in one MLP weight."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama_dir, base)
    weights = load_file(str(base / "model.safetensors"))
    name = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base


def _fetched(tiny_llama_dir: Path, base: Path, damage: str | None = None) -> Path:
    """The tiny Llama as `multitoken fetch` leaves it (every file recorded: size, sha256, mtime),
    then ``damage``d: a config edited in place (same size), a weight file grown, a tokenizer
    file removed."""
    from multitoken.base.weight_files import CONVERSION, files_record

    shutil.copytree(tiny_llama_dir, base)
    (base / CONVERSION).write_text(json.dumps({"files": files_record(base)}))
    if damage == "changed":
        text = (base / "config.json").read_text()
        (base / "config.json").write_text(text.replace('"silu"', '"gelu"'))
        assert len((base / "config.json").read_text()) == len(text)
    elif damage == "grown":
        with open(base / "model.safetensors", "ab") as f:
            f.write(b"\0")
    elif damage == "removed":
        os.remove(next(p for p in sorted(base.iterdir()) if p.name.startswith("tokenizer")))
    return base


def _gguf(path: Path, tail: bytes) -> Path:
    """A GGUF whose header is cut or garbage."""
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + tail)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama_dir) -> dict:
    """{name: (its folder or input, the finished run)} for every command line of the module."""
    root = tmp_path_factory.mktemp("backbone_errors")
    (root / "runs").mkdir()  # "runs/modle": its first folder exists here, so it is a path
    hub, fetched_cache = _hub_cache(root / "hub", tiny_llama_dir), root / "mt"  # SmolLM2 not fetched there
    fetched_cache.mkdir()
    offline = {**os.environ, **OFFLINE, "HF_HUB_CACHE": str(hub), "MULTITOKEN_CACHE": str(fetched_cache)}
    inputs = {"nan": _nan_base(tiny_llama_dir, root / "damaged"),
              **{f"fetched-{d}": _fetched(tiny_llama_dir, root / f"fetched-{d}", d) for d in FETCHED_DAMAGE},
              **{f"gguf-{t}": _gguf(root / f"{t}.gguf", raw) for t, raw in GGUF_TAILS.items()}}
    table = {"device-foo": _generate("--device", "foo"),
             **{f"device-{d}": _generate("--device", d) for d in _unavailable_devices()},
             **{f"path-{p}": _generate("--base", p, cwd=root, env=offline) for p in MISTYPED},
             "hub-unreachable": _generate("--base", "EleutherAI/pythia-70m", env=offline),
             "hub-offline": _generate("--base", "EleutherAI/pythia-70m", env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                                "HF_HUB_CACHE": str(hub), "MULTITOKEN_CACHE": str(fetched_cache)}),
             "fetched-not-yet": _generate("--base", "fetched:SmolLM2-135M-Instruct", env=offline),
             "hub-cached": _generate("--base", "someone/tiny-llama", "--json", env=offline),
             "4bit-embedded": _generate("--quantization", "4bit", "--json"),
             "4bit-fits-none": _generate("--base", tiny_llama_dir, "--quantization", "4bit", "--json"),
             **{name: _generate("--base", path, prompt="x") for name, path in inputs.items()}}
    done = run_forked(table, root / "zygote")
    return {name: (inputs.get(name), done[name]) for name in table}


def _one_error(done: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """The run failed with ``code`` and printed exactly one error: its line and its fix line."""
    lines = done.stderr.splitlines()
    assert done.returncode == code, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert len(lines) == 2 and lines[0].startswith("multitoken generate: error: ") and lines[1].startswith("  fix: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_unknown_device_is_refused(runs):
    _one_error(runs["device-foo"][1], 2, "unknown device 'foo'")


@pytest.mark.parametrize("device", _unavailable_devices())
def test_unavailable_device_is_refused(runs, device):
    line = _one_error(runs[f"device-{device}"][1], 2, f"device {device!r}")
    assert "not available" in line or "does not exist" in line


@pytest.mark.parametrize("spelling", MISTYPED)
def test_mistyped_local_path_is_not_found_without_asking_the_hub(runs, spelling):
    done = runs[f"path-{spelling}"][1]
    _one_error(done, 1, f"{spelling!r} not found")
    assert done.connects == []


@pytest.mark.parametrize("run, reason, connects", [("hub-unreachable", "Hub is unreachable (127.0.0.1", [PROBE]),
                                                   ("hub-offline", "HF_HUB_OFFLINE is set", [])])
def test_hub_id_offline_fails_fast_with_one_line(runs, run, reason, connects):
    done = runs[run][1]
    _one_error(done, 1, "'EleutherAI/pythia-70m' is not a local directory, not in the Hugging Face cache", reason)
    fix = done.stderr.splitlines()[1]  # one line: the names that work offline
    assert all(name in fix for name in ("fetched:SmolLM2-135M-Instruct", "multitoken fetch smollm2",
                                        "embedded:stories260K", "local checkpoint dir")), fix
    # No retries of huggingface_hub's: the probe's one connect at most, no request after it.
    # Timed from the command's start, after the imports every command pays first (made before the
    # fork), which say nothing about the Hub.
    assert done.connects == connects
    assert done.main_s < 3.0, f"{done.main_s:.1f} s"


def test_a_fetched_name_not_fetched_yet_says_to_fetch_it(runs):
    done = runs["fetched-not-yet"][1]
    _one_error(done, 1, "fetched:SmolLM2-135M-Instruct is not fetched on this machine")
    assert "multitoken fetch SmolLM2-135M-Instruct" in done.stderr


def test_hub_id_offline_loads_from_the_local_cache(runs):
    done = runs["hub-cached"][1]
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert '"token_ids"' in done.stdout
    # Every file from the cache: after the probe, at most huggingface_hub's own one-off request
    # (its agent registry, once per process, never retried), never a retried
    # request for a peft adapter's config.
    assert done.connects[0] == PROBE and len(done.connects) <= 2, done.connects


def test_4bit_on_the_embedded_model_quantizes_what_fits(runs, stories_dir):
    done = runs["4bit-embedded"][1]
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    notes = [line for line in done.stderr.splitlines() if line.startswith("note: 4bit")]
    if packed_cpu_4bit("cpu"):  # this CPU has AVX512-BF16: the 172-wide MLP cannot be packed
        assert notes == ["note: 4bit on this CPU (bitsandbytes' AVX512-BF16 kernel) needs out_features % 32 == 0 and "
                         "in_features % 64 == 0; 15 of 35 linear layers stay in float: model.layers.*.mlp.down_proj, "
                         "model.layers.*.mlp.gate_proj, model.layers.*.mlp.up_proj"]
    else:  # every kernel of this CPU takes any shape
        assert notes == []


def test_4bit_that_fits_no_layer_is_refused(runs):
    done = runs["4bit-fits-none"][1]
    if packed_cpu_4bit("cpu"):  # 32-wide: no Linear has in_features % 64 == 0
        _one_error(done, 2, "4bit quantization fits none of", "32x32")
    else:
        assert done.returncode == 0, done.stderr[-3000:]


# The split itself, for both kinds of CPU whatever this one is ------------------------------------
def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def test_packed_kernel_shape_rule():
    assert fits_4bit(96, 32, packed=False) and fits_4bit(172, 64, packed=False)
    assert not fits_4bit(96, 32, packed=True)  # in 32 < blocksize 64: "shape '[96, 0]' is invalid"
    assert not fits_4bit(172, 64, packed=True)  # out 172: "N must be divisible by block_n"
    assert not fits_4bit(64, 172, packed=True) and fits_4bit(32, 64, packed=True) and fits_4bit(192, 192, packed=True)


def test_quantized_layers_of_the_embedded_model(stories_dir):
    mlp = {f"model.layers.{i}.mlp.{p}": shape for i in range(5)
           for p, shape in (("gate_proj", (172, 64)), ("up_proj", (172, 64)), ("down_proj", (64, 172)))}
    packed = quantized_layers(_config(stories_dir), "4bit", "cpu", packed=True)
    assert packed.left_float == mlp and len(packed.quantized) == 20
    assert all(n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) for n in packed.quantized)
    skips = packed.skip_modules()
    assert skips[0] == "lm_head" and sorted(skips[1:]) == sorted(n.replace(".", r"\.") for n in mlp)
    for quantization, packed_cpu in (("4bit", False), ("8bit", True), ("8bit", False)):
        other = quantized_layers(_config(stories_dir), quantization, "cpu", packed=packed_cpu)
        assert other.left_float == {} and len(other.quantized) == 35 and other.skip_modules() is None


def test_quantized_test_models_fit_every_kernel(tiny_neox_q_dir, tiny_llama_q_dir, pythia_mini_dir, tiny_llama_dir):
    for path in (tiny_neox_q_dir, tiny_llama_q_dir, pythia_mini_dir):
        for packed in (True, False):
            assert quantized_layers(_config(path), "4bit", "cpu", packed=packed).left_float == {}, path
    assert quantized_layers(_config(tiny_llama_dir), "4bit", "cpu", packed=True).quantized == []  # why they exist


def test_partially_quantized_backbone_matches_its_layer_split_and_runs(stories_dir):
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    bb = load_backbone(BackboneConfig(base=str(stories_dir), quantization="4bit"))
    expected = quantized_layers(_config(stories_dir), "4bit", "cpu")
    assert bb.float_layers == expected.left_float
    modules = dict(bb.causal_lm.named_modules())
    assert {type(modules[n]).__name__ for n in expected.quantized} == {"Linear4bit"}
    assert {type(modules[n]).__name__ for n in expected.left_float} <= {"Linear"}
    ids = bb.tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():  # eval + no grad: the packed kernel's path on an AVX512-BF16 CPU
        quantized = bb.model(ids).logits
        ref = load_backbone(BackboneConfig(base=str(stories_dir))).model(ids).logits
    assert (quantized.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_a_base_with_a_nan_weight_is_refused_in_one_line(runs):
    """A damaged checkpoint (one NaN in one weight) fails as it loads, naming the weight, instead of
    decoding as garbage with exit 0."""
    from multitoken.base.errors import CheckpointError
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    base, done = runs["nan"]
    with pytest.raises(CheckpointError, match=r"mlp\.down_proj\.weight holds 1 non-finite values"):
        load_backbone(BackboneConfig(base=str(base)))
    assert done.returncode != 0 and "non-finite" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("damage", list(FETCHED_DAMAGE))
def test_a_fetched_folder_whose_files_changed_is_refused_in_one_line(runs, tiny_llama_dir, tmp_path, damage):
    """`multitoken fetch` records every file it wrote (size, sha256, mtime); a load checks them:
    a config edited in place (same size), a weight file grown, a tokenizer file removed."""
    from multitoken.base.errors import CheckpointError
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    load_backbone(BackboneConfig(base=str(_fetched(tiny_llama_dir, tmp_path / "fetched"))))  # as fetched: loads
    base, done = runs[f"fetched-{damage}"]
    expected = FETCHED_DAMAGE[damage]
    with pytest.raises(CheckpointError, match=expected):
        load_backbone(BackboneConfig(base=str(base)))
    assert done.returncode != 0 and expected in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("tail", list(GGUF_TAILS))
def test_a_damaged_gguf_is_named_in_one_line(runs, tail):
    """A GGUF whose header is cut or garbage: one line naming the file (not its folder), no
    struct.error traceback from transformers' reader."""
    pytest.importorskip("gguf", reason="GGUF bases need the [gguf] extra")
    bad, done = runs[f"gguf-{tail}"]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"{str(bad)!r} is not a GGUF file transformers can read" in done.stderr
