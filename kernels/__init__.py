"""CPU kernels: linear layers that read a weight in the format it is stored in.

A library of its own under the model code (it imports only ``multitoken.base`` and the cache
location in ``multitoken.embedded``): ``cpu_linear`` chooses and packs a model's linears
(``rows``: the multi-row GEMV compiled from ``rows_kernel.cpp``; ``packed``: oneDNN's prepacked
weights; ``stock``: torch's ``F.linear``), ``grid_weights`` finds the GGUF Q4_1 / Q8_0 codes a
float weight holds and keeps them, ``rows_kernel`` builds and loads the C++ (and the int16
argmax screen of ``grid_screen.cpp``), ``cpu_features`` is the one capability probe the code
and the tests ask. The exactness contract: a row's result does not depend on how many rows a
call holds, and the codes decode to the same float32 values the dense weight holds.
"""
