"""Dependencies' console output that says nothing to a multitoken user: progress bars
(transformers' "Loading weights", hub downloads, datasets), info logs, bitsandbytes' notices
about its own optional parts, and deprecation notices about dependencies' internals.

``quiet_dependencies()`` is the process-wide switch: the CLI calls it at start, the scripts
under ``scripts/`` through the benchmark and experiment harness (``pipeline/eval/benchmark.py``,
``pipeline/eval/experiment.py``) or their own call. The library never calls it on import;
``quiet_loading()`` silences only the span of our own model loads, restoring every setting
afterwards."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

# Environment variables, read when each library is first imported, so that `--help` imports
# none of them; a value the user set wins (e.g. TRANSFORMERS_VERBOSITY=info to debug a load).
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # also turns off transformers' bars (they ask the hub)
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
# Deprecation notices dependencies raise about their own internals (peft, transformers, hub):
# nothing a user can act on. Other warnings still show.
QUIET_WARNINGS = (
    (FutureWarning, r"(peft|transformers|huggingface_hub|datasets|accelerate)(\.|$)"),
    (DeprecationWarning, r"(peft|transformers|huggingface_hub|datasets|accelerate)(\.|$)"),
)
# Loggers whose warnings concern the dependency's own optional parts (bitsandbytes: "Failed to
# load CPU gemm_4bit_forward from kernels-community" when the optional `kernels` is absent).
QUIET_LOGGERS = ("bitsandbytes",)


def quiet_dependencies() -> None:
    """Keep dependencies' progress bars, info logs and internal deprecation notices off the
    console (and so out of ``--json`` output), for the rest of the process."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for category, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", category=category, module=module)
    if "transformers" in sys.modules:  # already imported: too late for the environment
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


@contextlib.contextmanager
def quiet_loading():
    """Within the block: no transformers progress bars or info logs, no bitsandbytes notices;
    afterwards every one of those settings is as it was (the caller's choice stands)."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
