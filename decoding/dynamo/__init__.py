"""DynaMo's dynamic multi-token step (DynaMo §3.2, Alg. 1): top-k of each head, joint grid,
co-occurrence mask, static + adaptive (blur + Otsu) thresholds, repetition penalty, back-off.

* ``step``: Alg. 1 itself (``dynamic_propose``), its candidates, grid, thresholds and back-off
  tests, the exact host top-k of CPU rows, and the choice of the kernel that builds a grid;
* ``sparse``: the exact sparse grid (only the cells of seen n-grams) in numpy, the reference of
* ``numba_step`` (its lookup), ``numba_otsu`` (its blur + Otsu) and ``numba_rows`` (the blur's
  row spans): the compiled kernels, the optional ``[fast]`` extra, imported only when chosen
  (importing this package does not import numba).
"""

from .step import (
    MIN_VOCAB,
    Candidates,
    Cells,
    DynamicChoice,
    always_backs_off,
    dynamic_propose,
    dynamic_step,
    exact_topk,
    gaussian_blur,
    head_candidates,
    heads_needed,
    joint_cells,
    joint_grid,
    otsu_keep,
    outer,
    prepare_kernel,
    repetition_cells,
    sample_index,
    top_candidates,
)

__all__ = [
    "MIN_VOCAB", "Candidates", "Cells", "DynamicChoice", "always_backs_off", "dynamic_propose", "dynamic_step",
    "exact_topk", "gaussian_blur", "head_candidates", "heads_needed", "joint_cells", "joint_grid",
    "otsu_keep", "outer", "prepare_kernel", "repetition_cells", "sample_index",
    "top_candidates",
]
