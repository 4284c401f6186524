"""The decoding step's runtime, apart from the model's definition: explicit KV caches and the
ragged batches they hold (``ragged``), one forward step over new tokens for the backbone and the
head layers (``incremental``), what a step hands the decoder (``step_output``) and how its rows
are unembedded (``unembed_costs``: the logits, or an argmax-only screen where measured cheaper).
``MultiTokenModel.step`` and ``new_caches`` are the model's side of ``decoding/protocol.py``."""
