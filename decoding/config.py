"""``DecodeConfig``: every decoding setting, in groups (sampling, DynaMo, speculation, trees);
it also drives ``multitoken generate`` (one flag per setting, one --help section per group).
Validated when a call starts (``validate``); the engine resolves its ``DecodePlan`` (plan.py) from it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from multitoken.base.boundary import check_group, check_setting_types, unknown_setting
from multitoken.base.config_io import nested
from multitoken.base.errors import UsageError


MODES = ("ar", "dynamic", "speculative", "typical")
VERIFYING_MODES = ("speculative", "typical")  # the modes whose drafts the base model verifies
KERNELS = ("auto", "dense", "numpy", "numba")  # how DynaMo's grids are built (dynamo/)
TREES = ("chain", "static", "dynamic")
MAX_TREE_NODES = 256
DRAFTERS = ("auto", "independent", "cp", "joint", "eagle3")
JOINTS = ("auto", "conditional", "outer")  # how DynaMo's grids join the heads (dynamo/step.py: Prefix)
DYNAMO_PENALTY = 1.1  # DynaMo's repetition penalty (its sampling setting)


@dataclass
class Sampling:
    """How a token is drawn from the base's distribution (and every draft from a head's)."""

    greedy: bool = field(default=False, metadata={"help": "argmax decoding instead of sampling (ar / speculative / typical then ignore --temperature and --top-k, as transformers does; dynamic still builds its grid with them)"})
    temperature: float = field(default=0.7, metadata={"help": "sampling temperature (> 0 unless --greedy)"})
    top_k: int = field(default=50, metadata={"help": "sample among the k most likely tokens of each head (the vocabulary size: no cut)"})
    repetition_penalty: float | None = field(default=None, metadata={"help": (
        "DynaMo's repetition penalty, in every mode: after temperature and top-k, the probability of each token "
        "already in the context (dynamic grids: also a cell repeating itself) is divided by it, then renormalised "
        "(1 = off). Default: 1.1 (DynaMo's) when sampling, 1 with --greedy (the base model's argmax); "
        "a value given applies with --greedy too")})
    seed: int = field(default=0, metadata={"help": "random seed"})

    @property
    def penalty(self) -> float:
        """The repetition penalty in force: the one given, else DynaMo's 1.1 when sampling and 1
        (off) when greedy, so that greedy decoding is the base model's argmax unless asked."""
        if self.repetition_penalty is not None:
            return float(self.repetition_penalty)
        return 1.0 if self.greedy else DYNAMO_PENALTY

    @property
    def grid_temperature(self) -> float:
        """The temperature of the heads' top-k probabilities in DynaMo's grids and the joint
        drafts and trees (1 where the temperature is 0: greedy)."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class DynamoOptions:
    """DynaMo's joint proposal and back-off (Alg. 1), and how its grids are built."""

    eps_b: float = field(default=0.5, metadata={"help": "back-off threshold in [0, 1]: order n needs a cell > eps_b^(n-1)"})
    alpha_c: float = field(default=1.0, metadata={"help": "co-occurrence mask exponent (0 = no mask)"})
    static_threshold: bool = field(default=True, metadata={"help": "zero cells <= eps_b^(n-1)"})
    adaptive_threshold: bool = field(default=True, metadata={"help": "Otsu adaptive thresholding of the joint grid"})
    blur_kernel: int = field(default=3, metadata={"help": "Gaussian blur kernel before Otsu (odd; 0 or 1 = no blur)"})
    dynamic_joint: str = field(default="auto", metadata={"help": (
        "how --mode dynamic joins the heads: conditional (the base's token t+1 sampled first, then the drafter's "
        "distribution for t+2.. given the sampled tokens, order by order: conditioned and eagle3 heads), outer "
        "(DynaMo's outer product of the heads' marginals); auto = conditional for heads that condition, else outer"),
        "choices": JOINTS})
    dynamic_kernel: str = field(default="auto", metadata={"help": (
        "how dynamic / joint-draft grids are built: dense (the whole k^n grid, the reference), numpy or numba "
        "(only the seen n-grams, identical results; used where exact: a stats table with absent ratio 0 and "
        "--alpha-c > 0, else dense); auto = numba when installed (pip install multitoken[fast]), else numpy"),
        "choices": KERNELS})

    @property
    def kernel(self) -> str:
        """The kernel ``dynamic_kernel`` resolves to on this machine."""
        return resolve_kernel(self.dynamic_kernel)


@dataclass
class Speculation:
    """Drafts and their verification (speculative and typical modes)."""

    drafter: str = field(default="auto", metadata={"help": "drafts: independent heads, cp (sequential), joint (co-occurrence-masked joint), eagle3 (its drafter, autoregressive); auto = eagle3 / cp for those heads, else joint with stats, else independent", "choices": DRAFTERS})
    draft_k: int = field(default=20, metadata={"help": "joint drafter: candidates per head (acceptance barely moves past ~20, lookup cost does)"})
    draft_vocab: int | None = field(default=None, metadata={"help": (
        "layer heads' drafts score only their N most frequent training tokens (FR-Spec; verification still reads the "
        "whole vocabulary, so greedy and sampled output stay exact); 0 = the whole vocabulary; default: the size "
        "recorded beside the heads (draft_vocab.json), else the whole vocabulary")})
    lookup: int = field(default=0, metadata={"help": (
        "speculative / typical: also verify up to K tokens copied from the context (prompt lookup decoding): those "
        "that followed the latest earlier occurrence of its last 1-3 tokens, one more branch beside the heads' "
        "chain or tree, in the same forward pass (greedy and sampled output stay exact); 0 = off")})
    typical_eps: float = field(default=0.09, metadata={"help": "typical acceptance: posterior threshold eps"})
    typical_delta: float = field(default=0.3, metadata={"help": "typical acceptance: entropy factor delta"})


@dataclass
class TreeOptions:
    """Candidate trees verified in one pass (speculative and typical modes)."""

    tree: str = field(default="chain", metadata={"help": (
        "speculative / typical: verify one chain of drafts (chain), or a tree of several guesses per head in one "
        "forward pass: static (Medusa: a fixed shape from the heads' measured per-rank accuracies, written beside "
        "the heads by `multitoken eval`) or dynamic (EAGLE-2: the step's own head probabilities; with the joint "
        "drafter, e.g. auto with stats, their co-occurrence-masked joint over --draft-k candidates per head)"), "choices": TREES})
    tree_nodes: str = field(default="auto", metadata={"help": (
        "tree candidates per step besides the committed token (1..256), or auto: the budget with the most "
        "expected tokens per second, timing the verify step on this machine once per process")})


GROUPS = {"sampling": Sampling, "dynamo": DynamoOptions, "speculation": Speculation, "trees": TreeOptions}
FLAT = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}  # a setting's name -> its group


@dataclass(init=False)
class DecodeConfig:
    """Every decoding setting: the mode and budget, then one group per concern. Built from the
    groups or from the settings' own names (the command line's flags), which go to their
    group: ``DecodeConfig(mode="dynamic", eps_b=0.3, greedy=True)``; ``dataclasses.replace``
    takes them too."""

    mode: str = field(default="speculative", metadata={"help": "ar | dynamic (DynaMo, lossy) | speculative (lossless) | typical (Medusa)", "choices": MODES})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens to generate"})
    n: int | None = field(default=None, metadata={"help": "tokens per forward at most (default: every head)"})
    stop_at_eos: bool = field(default=True, metadata={"help": "stop after the tokenizer's end-of-sequence token"})
    sampling: Sampling = nested(Sampling)
    dynamo: DynamoOptions = nested(DynamoOptions)
    speculation: Speculation = nested(Speculation)
    trees: TreeOptions = nested(TreeOptions)

    @staticmethod
    def settings() -> set[str]:
        """Every setting's name, the groups' included (what the constructor takes)."""
        return {f.name for f in fields(DecodeConfig) if f.name not in GROUPS} | set(FLAT)

    def __init__(self, mode: str = "speculative", max_new_tokens: int = 128, n: int | None = None, stop_at_eos: bool = True,
                 sampling=None, dynamo=None, speculation=None, trees=None, **settings):
        self.mode, self.max_new_tokens, self.n, self.stop_at_eos = mode, max_new_tokens, n, stop_at_eos
        given = {"sampling": sampling, "dynamo": dynamo, "speculation": speculation, "trees": trees}
        for name, cls in GROUPS.items():
            group = given[name]
            group = replace(check_group(name, cls, group)) if group is not None else cls()
            setattr(self, name, group)  # a copy: a group is never shared between configs
        for key, value in settings.items():
            if key not in FLAT:
                raise unknown_setting(key, self.settings())
            setattr(getattr(self, FLAT[key]), key, value)
        self.check_types()

    @property
    def verifies(self) -> bool:
        """Whether this mode verifies drafts (speculative, typical); ar drafts nothing and
        DynaMo's back-off commits its tokens unverified. Decided here only."""
        return self.mode in VERIFYING_MODES

    def check_types(self) -> None:
        """Every setting holds a value of its type (UsageError naming it): a Python caller's
        ``seed=1.5`` or ``max_new_tokens="5"`` is refused here, not truncated or failed on later."""
        check_setting_types(self)
        for name in GROUPS:
            check_setting_types(getattr(self, name))

    def validate(self, *, vocab_size: int | None = None, n_heads: int | None = None, max_order: int | None = None,
                 table=None) -> None:
        """Reject settings that cannot work (clear message + fix). Without ``vocab_size`` and
        ``n_heads`` only the flags themselves are checked (before a model loads); with them, the
        model-dependent bounds too. ``max_order``: the highest order the stats let dynamic
        decoding build (None: every head), which bounds its k^n grid. ``table``: the stats, whose
        largest ratio bounds --alpha-c. Cheap, so the command line (before it decodes) and the
        engine (when it starts) each check."""
        import math

        self.check_types()  # settings may have been assigned since construction
        if self.mode not in MODES:
            raise UsageError(f"unknown mode {self.mode!r}", f"use one of {', '.join(MODES)}")
        if self.speculation.drafter not in DRAFTERS:
            raise UsageError(f"unknown drafter {self.speculation.drafter!r}", f"use one of {', '.join(DRAFTERS)}")
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        check_seed(self.sampling.seed)
        floats = {"eps-b": self.dynamo.eps_b, "temperature": self.sampling.temperature, "alpha-c": self.dynamo.alpha_c,
                  "repetition-penalty": self.sampling.penalty, "typical-eps": self.speculation.typical_eps, "typical-delta": self.speculation.typical_delta}
        for name, value in floats.items():
            if not math.isfinite(value):
                raise UsageError(f"--{name} must be a finite number, got {value}")
        if not 0.0 <= self.dynamo.eps_b <= 1.0:
            raise UsageError(f"--eps-b must be in [0, 1], got {self.dynamo.eps_b}", "0 always emits n tokens, 1 always one")
        if self.sampling.top_k < 1:
            raise UsageError(f"--top-k must be >= 1, got {self.sampling.top_k}")
        if vocab_size is not None and self.sampling.top_k > vocab_size:
            raise UsageError(f"--top-k must be in [1, {vocab_size}] (the vocabulary size), got {self.sampling.top_k}",
                             f"--top-k {vocab_size} samples from the whole vocabulary")
        if not self.sampling.greedy and not self.sampling.temperature > 0:
            raise UsageError(f"temperature must be > 0 when sampling, got {self.sampling.temperature}", "pass --greedy for argmax decoding")
        if self.n is not None and self.n < 1:
            raise UsageError(f"--n must be >= 1, got {self.n}")
        if self.n is not None and n_heads is not None and self.n > n_heads:
            raise UsageError(f"--n {self.n} needs {self.n} heads, the model's heads predict {n_heads} token(s) per position",
                             f"pass --n between 1 and {n_heads}, or heads trained for more tokens (--heads DIR)")
        if self.dynamo.dynamic_joint not in JOINTS:
            raise UsageError(f"unknown dynamic joint {self.dynamo.dynamic_joint!r}", f"use one of {', '.join(JOINTS)}")
        if self.dynamo.dynamic_kernel not in KERNELS:
            raise UsageError(f"unknown dynamic kernel {self.dynamo.dynamic_kernel!r}", f"use one of {', '.join(KERNELS)}")
        if self.dynamo.dynamic_kernel == "numba" and not numba_available():
            raise UsageError("--dynamic-kernel numba needs numba, which is not installed",
                             "pip install 'multitoken[fast]', or use --dynamic-kernel auto")
        if self.speculation.draft_vocab is not None and self.speculation.draft_vocab < 0:
            raise UsageError(f"--draft-vocab must be >= 0, got {self.speculation.draft_vocab}", "pass 0 for the whole vocabulary")
        if self.speculation.draft_k < 1:
            raise UsageError(f"--draft-k must be >= 1, got {self.speculation.draft_k}")
        if not 0 <= self.dynamo.alpha_c <= MAX_ALPHA_C:
            raise UsageError(f"--alpha-c must be in [0, {MAX_ALPHA_C}], got {self.dynamo.alpha_c:g}",
                             "DynaMo uses 1 (0 turns the mask off); 4 ** 64 already overflows float32")
        check_alpha(self.dynamo.alpha_c, table)
        if not self.sampling.penalty >= 1:
            raise UsageError(f"--repetition-penalty must be >= 1, got {self.sampling.repetition_penalty}", "1 turns it off")
        if self.dynamo.blur_kernel < 0 or (self.dynamo.blur_kernel > 1 and self.dynamo.blur_kernel % 2 == 0):
            raise UsageError(f"--blur-kernel must be 0 or 1 (no blur) or an odd number >= 3, got {self.dynamo.blur_kernel}")
        if self.dynamo.blur_kernel > MAX_BLUR_KERNEL:
            raise UsageError(f"--blur-kernel must be <= {MAX_BLUR_KERNEL}, got {self.dynamo.blur_kernel}",
                             "DynaMo blurs with 3; a kernel wider than the grid only flattens it")
        if not (0 < self.speculation.typical_eps <= 1 and self.speculation.typical_delta > 0):
            raise UsageError("typical acceptance needs 0 < --typical-eps <= 1 and --typical-delta > 0")
        self._validate_tree()
        if self.mode == "dynamic" and n_heads is not None:
            order = min(self.order(n_heads), max_order or n_heads)
            check_grid(min(self.sampling.top_k, vocab_size or self.sampling.top_k), order)

    def _validate_tree(self) -> None:
        if self.trees.tree not in TREES:
            raise UsageError(f"unknown tree {self.trees.tree!r}", f"use one of {', '.join(TREES)}")
        if self.trees.tree != "chain" and not self.verifies:
            raise UsageError(f"--tree {self.trees.tree} verifies drafts: it needs --mode speculative or typical, not {self.mode}",
                             "pass --mode speculative, or leave --tree at chain")
        if self.trees.tree == "chain" and str(self.trees.tree_nodes) != "auto":
            raise UsageError(f"--tree-nodes {self.trees.tree_nodes} sizes a tree, but --tree is chain (one chain of drafts)",
                             "pass --tree static|dynamic, or drop --tree-nodes")
        if not 0 <= self.speculation.lookup <= MAX_TREE_NODES:
            raise UsageError(f"--lookup must be in [0, {MAX_TREE_NODES}], got {self.speculation.lookup}",
                             "0 turns it off; transformers' prompt lookup drafts 10 tokens")
        if self.speculation.lookup and not self.verifies:
            raise UsageError(f"--lookup adds a branch copied from the context for verification to judge: it needs "
                             f"--mode speculative or typical, not {self.mode} (DynaMo's back-off keeps no verification)",
                             "pass --mode speculative, or drop --lookup")
        if str(self.trees.tree_nodes) != "auto":
            try:
                nodes = int(self.trees.tree_nodes)
            except ValueError:
                raise UsageError(f"--tree-nodes must be an integer or auto, got {self.trees.tree_nodes!r}") from None
            if not 1 <= nodes <= MAX_TREE_NODES:
                raise UsageError(f"--tree-nodes must be in [1, {MAX_TREE_NODES}], got {nodes}",
                                 "Medusa and EAGLE-2 use 26 to 64; auto picks one for this machine")

    def resolved(self) -> "DecodeConfig":
        """A copy with every default that depends on other settings made explicit (recorded)."""
        return replace(self, repetition_penalty=self.sampling.penalty)

    def order(self, n_heads: int) -> int:
        """Tokens per forward at most: 1 in ar mode, else ``n`` (default every head)."""
        return 1 if self.mode == "ar" else (self.n or n_heads)


def numba_available() -> bool:
    """Whether the optional ``[fast]`` extra (numba) is installed, without importing it."""
    import importlib.util

    return importlib.util.find_spec("numba") is not None


def resolve_kernel(name: str) -> str:
    """``--dynamic-kernel``: ``auto`` -> numba when installed, else numpy; the others as given."""
    if name == "auto":
        return "numba" if numba_available() else "numpy"
    return name


def stats_order_cap(cfg: DecodeConfig, n_heads: int, table, joint_drafter: bool) -> int | None:
    """The stats' highest order when decoding would mask more positions than it holds (dynamic
    or joint drafts, e.g. 4 heads with order-3 stats): only that many heads are read then."""
    top = getattr(table, "max_order", None)  # a table with only .mask() masks any order
    masks = top is not None and cfg.dynamo.alpha_c > 0 and (cfg.mode == "dynamic" or joint_drafter)
    return top if masks and cfg.order(n_heads) > top else None


def check_context(n_prompt: int, max_new: int, context: int) -> None:
    """The prompt and the generated tokens must fit the model's context."""
    if n_prompt >= context:
        raise UsageError(f"the prompt has {n_prompt} tokens, the model's context is {context}", "shorten the prompt")
    if n_prompt + max_new > context:
        raise UsageError(
            f"prompt ({n_prompt} tokens) + --max-new-tokens ({max_new}) exceeds the model's context of {context}",
            "shorten the prompt or lower --max-new-tokens",
        )


# The mask is ratio ** alpha_c in float32 (max 3.4e38): 4 ** 64 passes it, so no larger exponent
# is meaningful. With stats at hand the bound is their own largest ratio: a cell, and the sum of a
# whole grid of MAX_GRID_CELLS cells, must stay finite (log(3.4e38) - log(2**24) = 72).
MAX_ALPHA_C = 64
FLOAT32_LOG_ROOM = 72.0


def check_alpha(alpha: float, table) -> None:
    """Refuse an --alpha-c under which the stats' largest co-occurrence ratio overflows float32
    (every grid turns NaN and each step backs off to one token)."""
    import math

    top = max_ratio(table) if table is not None and alpha > 0 else None
    if top is None or top <= 1:
        return
    limit = FLOAT32_LOG_ROOM / math.log(top)
    if alpha > limit:
        raise UsageError(f"--alpha-c {alpha:g} overflows float32 with these stats: their co-occurrence ratios reach "
                         f"{top:.3g}, and ratio ** alpha_c must stay below e^{FLOAT32_LOG_ROOM:g}",
                         f"pass --alpha-c {math.floor(limit * 100) / 100:g} or less (DynaMo uses 1)")


def max_ratio(table) -> float | None:
    """An upper bound of the table's ratios p(x_1..x_n) / prod p(x_i) = c * N1^n / N_n / prod u_i:
    an n-gram's count c is at most each of its unigram counts u_i, so a ratio is at most
    N1^n / N_n / u_min^(n-1). None for a stand-in table without totals."""
    totals, inv = getattr(table, "totals", None), getattr(table, "inv_unigrams", None)
    if not totals or inv is None or not len(inv):
        return None
    inv_max = float(max(inv.max(), 0))  # 1 / the smallest seen unigram count
    bounds = [totals[1] ** n / totals[n] * inv_max ** (n - 1) for n in totals if n >= 2 and totals[n] > 0]
    return max(bounds + [float(getattr(table, "absent", 0.0))])


MAX_SEED = 2**63 - 1  # torch.Generator takes any 64-bit value; numpy and our records take non-negative ones
MAX_BLUR_KERNEL = 99
MAX_GRID_CELLS = 1 << 24  # DynaMo's k^n grid: 16.8M float32 cells, 64 MiB per copy, ~0.6 GB at peak


def check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed must be in [0, 2**63 - 1], got {seed}", "pass a non-negative seed, e.g. --seed 0")


def check_grid(k: int, order: int) -> None:
    """Dynamic decoding builds a k^order joint grid (several float32 copies) each step: refuse
    one past MAX_GRID_CELLS, naming the k and n that would fit (--top-k 512 with 3 heads took
    4.5 GB; 100 heads would need 58+ GiB)."""
    import math

    cells = k ** order
    if order < 2 or cells <= MAX_GRID_CELLS:
        return
    fit_k = int(MAX_GRID_CELLS ** (1 / order) + 1e-9)
    fit_n = int(math.log(MAX_GRID_CELLS) / math.log(k) + 1e-9)
    size = (f"{cells:,} cells, {cells * 4 / 2**30:.1f} GiB per float32 copy" if cells < 2**60
            else f"about 10^{int(order * math.log10(k))} cells")
    raise UsageError(
        f"--mode dynamic with --top-k {k} and n = {order} tokens per step builds a {k}^{order} grid "
        f"({size}), past the limit of {MAX_GRID_CELLS:,} cells",
        ", or ".join([f"lower --top-k to {fit_k} or less"] * (fit_k >= 2) + [f"pass --n {fit_n}"] * (fit_n >= 2)) or "use another mode")
