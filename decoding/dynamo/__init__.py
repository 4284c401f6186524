"""DynaMo's dynamic multi-token step (DynaMo §3.2, Alg. 1): top-k of each head, joint grid,
co-occurrence mask, static + adaptive (blur + Otsu) thresholds, repetition penalty, back-off.

* ``step``: Alg. 1 itself (``dynamic_propose``), its grid, thresholds and back-off tests, Alg. 1
  over conditional drafts (``Prefix``, ``conditional_propose``: the joint's rows given the sampled prefix),
  and the choice of the kernel that builds a grid;
* ``sparse``: the exact sparse grid (only the cells of seen n-grams) in numpy, the reference of
* ``numba_step`` (its lookup), ``numba_otsu`` (its blur + Otsu) and ``numba_rows`` (the blur's
  row spans): the compiled kernels, the optional ``[fast]`` extra, imported only when chosen
  (importing this package does not import numba).
"""

from ..sampling import MIN_VOCAB, Candidates, exact_topk, head_candidates, top_candidates
from .step import (
    Cells,
    DynamicChoice,
    Prefix,
    always_backs_off,
    conditional_propose,
    dynamic_propose,
    dynamic_step,
    first_token,
    gaussian_blur,
    heads_needed,
    joint_cells,
    joint_grid,
    otsu_keep,
    outer,
    prepare_kernel,
    repetition_cells,
    sample_index,
)

__all__ = [
    "MIN_VOCAB", "Candidates", "Cells", "DynamicChoice", "Prefix", "always_backs_off", "conditional_propose", "dynamic_propose",
    "dynamic_step", "first_token",
    "exact_topk", "gaussian_blur", "head_candidates", "heads_needed", "joint_cells", "joint_grid",
    "otsu_keep", "outer", "prepare_kernel", "repetition_cells", "sample_index",
    "top_candidates",
]
