"""The floor every other module stands on: errors, atomic files and directories, output guards,
resolved-config saving, data reading and packing, tokenizer loading, threads.

It imports nothing of ours outside itself (``multitoken.embedded``, a data package on the same
floor, aside), and this ``__init__`` imports nothing at all, so ``import multitoken.base.errors``
stays cheap. Its folder is its import path (``base/`` is ``multitoken.base``), beside the
floors above it, so importing it never runs a higher floor's package.
"""
