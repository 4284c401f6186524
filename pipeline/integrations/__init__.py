"""Our heads inside other libraries' own entry points: transformers' ``generate``
(``hf_generate.with_heads``, its ``custom_generate``)."""
