"""CPU kernels: linear layers that read a weight in the format it is stored in (docs/kernels.md).

A library of its own under the model code (it imports only ``multitoken.base`` and the cache
location in ``multitoken.embedded``): ``formats`` names the weight formats (one enum, its values
handed to the C++), ``format_table`` gives each its pack / linear / argmax / plain reference,
``cpu_linear`` packs a model's linears in them (``PackedLinear``), ``gemv_rows`` builds the C++
(``ops.cpp``: torch ops with schemas and checks over ``gemv_rows.cpp``, the multi-row GEMV, and
``argmax_prefilter.cpp``, the Q8_0 codes' int16 prefilter) and runs the float32 blocks,
``gguf_codes`` finds GGUF's Q4_1 / Q8_0 codes (and 16-bit floats) a float weight holds, and
``cpu_features`` is the one capability probe the code and the tests ask. The exactness contract:
a row's result does not depend on how many rows a call holds, and a narrow format's logits are
the float32 blocks' of the same values, bit for bit.
"""
