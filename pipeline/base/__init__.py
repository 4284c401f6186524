"""The floor every other module stands on: errors, atomic files and directories, output guards,
resolved-config saving, data reading and packing, tokenizer loading, threads.

It imports nothing of ours outside itself (``multitoken.pipeline.embedded``, a data package,
aside), and this ``__init__`` imports nothing at all, so ``import multitoken.pipeline.base.errors``
stays cheap.
"""
