"""Where a model comes from: the pretrained bases a registry ships, made local once (``fetch``),
llama2.c checkpoints converted to transformers' format (``llama2c``), and the one loader of the
heads, stats and base the package ships or the user names (``assets``: ``load_model``).

Imports nothing eagerly; public names are re-exported lazily by ``multitoken.pipeline``.
"""
