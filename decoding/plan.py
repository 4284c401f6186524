"""``DecodePlan``: every choice a decoding call makes from its settings and its model, made once
when the call starts (``resolve``) and read by the engine, the proposers and the verifier.

Each choice is written here only: whether the mode verifies drafts, whether a step needs only
the base's argmax (greedy without a repetition penalty), which drafter drafts a chain, which
candidates a step feeds (DynaMo's final tokens, a chain, or a tree, and which tree), which rule
verifies them, how many heads a step computes. The rest of decoding reads the plan's fields and
tests no setting, and no function's identity, again.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import DecodeConfig, stats_order_cap
from .dynamo.step import always_backs_off
from multitoken.base.errors import UsageError


@dataclass(frozen=True)
class DecodePlan:
    mode: str
    verifies: bool  # drafts are verified by the base (speculative, typical); ar and dynamic verify none
    greedy: bool
    penalty: float  # the repetition penalty in force
    penalised: bool  # penalty != 1: every target and argmax reads the row's context
    argmax_only: bool  # greedy without a penalty: the base's argmax is all a step reads (no logits)
    order: int  # tokens per forward at most, the stats' cap applied
    stats_cap: int | None  # the stats' highest order where it caps the heads read, else None
    heads_read: int  # heads a pass computes (DynaMo at eps_b = 1 backs off unread: head 1 only)
    proposer: str  # "dynamo": DynaMo's final tokens; "chain": the base's token and a chain of drafts; "tree": a candidate tree
    drafter: str | None  # a chain's: independent | argmax (independent, greedy, no penalty) | cp | joint | eagle3 | custom
    # (eagle3: its dynamic tree's and DynaMo's conditional joint's too); None: no drafts
    joint: str | None  # DynaMo's grids: "outer" (the heads' marginals) | "conditional" (dynamo/step.py: Prefix); None: not dynamic
    defer_heads: bool  # the pass leaves the heads that read token t+1 until DynaMo's t+1 is sampled (StepOutput.condition)
    tree: str  # the tree proposer's shape: "path" (--lookup on a chain: the heads' top guesses as one path), static, dynamic; else "chain"
    lookup: int  # a branch of up to this many tokens copied from the context, grafted on the tree (0: none)
    joint_tree: bool  # a dynamic tree ranked by DynaMo's co-occurrence-masked joint (the joint drafter's)
    device_tree: bool  # a static tree judged greedily on the device: its tokens and verdict read together
    rule: str | None  # verification: greedy | sampled | typical | custom (a caller's chain rule); None: nothing verified
    grids: bool  # builds DynaMo grids (dynamic steps, joint drafts, dynamic trees): their kernel is prepared first
    draft_vocab: int | None  # --draft-vocab (the caches' draft unembedding)

    def describe(self) -> str:
        """The plan in words (the trace's ``plan``, shown by ``generate --verbose``)."""
        if self.proposer == "dynamo":
            what = "DynaMo's back-off, committed unverified" + (
                f", over the conditional joint (t+2.. from the {'eagle3 drafter' if self.drafter else 'conditioned heads'}"
                " given the sampled tokens)" if self.joint == "conditional" else "")
        elif self.proposer == "chain":
            what = f"a chain of {self.drafter} drafts" if self.drafter else "the base's next token, no drafts"
        else:
            what = ("the heads' top guesses as one path (--lookup on a chain)" if self.tree == "path"
                    else f"a {self.tree} tree" + (" ranked by the co-occurrence-masked joint" if self.joint_tree else
                                                  " grown by the eagle3 drafter" if self.drafter == "eagle3" else ""))
            what += f", with a lookup branch of up to {self.lookup} tokens" if self.lookup else ""
        judged = f", verified by the {self.rule} rule" if self.rule else ""
        reads = "the base's argmax only" if self.argmax_only and self.rule in (None, "greedy") else "the base's logits"
        return f"{what}{judged}; {self.heads_read} head(s) computed, {reads}"


def resolve(cfg: DecodeConfig, model, table=None, drafter=None, acceptor=None) -> DecodePlan:
    """The plan of ``cfg`` (validated) on ``model`` (its ``n_future`` heads) with
    the stats ``table`` (or None); ``drafter`` / ``acceptor``: a caller's chain drafter / chain rule."""
    n_heads, sampling = model.n_future, cfg.sampling
    one_chain = cfg.trees.tree == "chain" and not cfg.speculation.lookup  # a lookup branch makes the chain a tree
    if not one_chain and (drafter is not None or acceptor is not None):
        raise UsageError("--tree static / dynamic build their own candidates and acceptance",
                         "pass --tree chain with a custom drafter or acceptor")
    own = drafts_autoregressively(model.heads)
    joint = dynamic_joint(cfg.dynamo.dynamic_joint, model.heads) if cfg.mode == "dynamic" else None
    if own and (cfg.trees.tree == "static" or cfg.speculation.lookup):
        raise UsageError("eagle3 heads draft chains, dynamic trees and DynaMo's conditional joint only: --tree static and "
                         "--lookup are not available with them", "use --tree chain or dynamic")
    argmax_only = sampling.greedy and sampling.penalty == 1
    proposer = "dynamo" if cfg.mode == "dynamic" else "chain" if one_chain else "tree"
    named = drafter_name(cfg.speculation.drafter, model.heads, table) if cfg.verifies else None
    chain_drafter = _chain_drafter(named, drafter, argmax_only) if cfg.verifies and one_chain else (
        "eagle3" if cfg.verifies and own else None)  # eagle3's trees are its drafter's too
    cap = stats_order_cap(cfg, n_heads, table, chain_drafter == "joint")
    tree = "chain" if proposer != "tree" else "path" if cfg.trees.tree == "chain" else cfg.trees.tree
    joint_tree = tree == "dynamic" and table is not None and named == "joint" and getattr(table, "max_order", 2) >= 2
    rule = None if not cfg.verifies else "custom" if acceptor is not None else (
        "typical" if cfg.mode == "typical" else "greedy" if sampling.greedy else "sampled")
    order = cap or cfg.order(n_heads)
    unread = cfg.mode == "dynamic" and always_backs_off(cfg)  # every order backs off unread: head 1 only
    if joint == "conditional" and own and not unread:
        chain_drafter = "eagle3"  # DynaMo's conditionals come from the drafter's own steps
    return DecodePlan(
        mode=cfg.mode, verifies=cfg.verifies, greedy=sampling.greedy, penalty=sampling.penalty,
        penalised=sampling.penalty != 1, argmax_only=argmax_only, order=order, stats_cap=cap,
        # heads past those read are never computed; the eagle3 drafter runs in the proposer, not in the pass
        heads_read=1 if unread or chain_drafter == "eagle3" else order,
        proposer=proposer, drafter=chain_drafter, joint=joint,
        defer_heads=joint == "conditional" and not own and not unread and order > 1, tree=tree, lookup=cfg.speculation.lookup, joint_tree=joint_tree,
        device_tree=tree == "static" and rule == "greedy" and not cfg.speculation.lookup, rule=rule,
        grids=cfg.mode == "dynamic" or chain_drafter == "joint" or tree == "dynamic" and chain_drafter != "eagle3",
        draft_vocab=cfg.speculation.draft_vocab)


def dynamic_joint(name: str, heads) -> str:
    """``--dynamic-joint``: ``auto`` is conditional for heads that read the sampled token t+1
    (conditioned, eagle3), else outer; conditional needs such heads, and eagle3 heads have no
    per-head marginals for the outer product."""
    conditions = getattr(heads, "needs_next_tokens", False)
    if name == "auto":
        return "conditional" if conditions else "outer"
    kind = heads.config.head_type if heads is not None else "no"
    if name == "conditional" and not conditions:
        raise UsageError(f"--dynamic-joint conditional needs heads that read the sampled token (conditioned, eagle3), "
                         f"these are {kind!r}", "use --dynamic-joint auto or outer")
    if name == "outer" and drafts_autoregressively(heads):
        raise UsageError("--dynamic-joint outer multiplies per-head marginals, which eagle3 heads do not have",
                         "use --dynamic-joint auto or conditional")
    return name


def drafts_autoregressively(heads) -> bool:
    """Heads that are a drafter of their own, run step by step with a KV cache (eagle3)."""
    return getattr(heads, "drafts_autoregressively", False)


def drafter_name(name: str, heads, table=None) -> str:
    """``--drafter``: ``auto`` is eagle3 for eagle3 heads, cp for CP heads (sequential drafts),
    else joint when a co-occurrence table is at hand (it raises acceptance), else independent;
    cp needs CP heads, eagle3 eagle3 heads (which draft with nothing else)."""
    sequential, own = getattr(heads, "supports_sequential_drafts", False), drafts_autoregressively(heads)
    if name == "auto":
        name = "eagle3" if own else "cp" if sequential else "joint" if table is not None else "independent"
    if (name == "eagle3") != own:
        kind = heads.config.head_type if heads is not None else "no"
        raise UsageError(f"--drafter {name} does not draft with {kind!r} heads",
                         "use --drafter auto" + (" (eagle3 heads draft with their own drafter)" if own else ""))
    if name == "cp" and not sequential:
        raise UsageError(f"--drafter cp needs cp heads, these are {heads.config.head_type!r}", "use --drafter independent or joint")
    return name


def _chain_drafter(named: str, custom, argmax_only: bool) -> str:
    """The drafter of a chain: a caller's own, else the named one; greedy independent drafts
    without a penalty are each head's argmax (every row's in one call)."""
    if custom is not None:
        return "custom"
    return "argmax" if named == "independent" and argmax_only else named
