"""Where a decoding step's time goes: torch.profiler over ``generate``, each op the profiler
records attributed to the part of the model it ran in, and the time no op accounts for.

``labelled(model)`` wraps, for the duration of a ``with``, the forward of every module of
interest (and a packed linear's ``argmax``, the greedy unembedding) in a ``record_function``
label: ``mt.linear:<format>:<name>`` for a linear (``stock`` where it is not packed), and
``mt.attention`` / ``mt.rotary`` / ``mt.norm`` / ``mt.mlp`` / ``mt.embed`` / ``mt.layer`` by
module class, ``mt.step`` around ``model.step``. Nothing else changes: the wrappers are instance
attributes, removed on exit.

``attribute(events, ...)`` reads the profiler's events on the thread that ran ``generate``,
from the end of the prompt's pass (the first ``mt.step``) to the end of the run: an op whose
callers are only labels is a *top-level* op (the time C++ spent on behalf of one Python call);
its time goes to the innermost label around it (our kernels, ``multitoken_<level>::*``, to
their format and linear). What no top-level op covers is Python and dispatch between ops: the
interpreter, module calls, argument parsing, the profiler's own cost per op (which is why the
unprofiled step's wall time is measured beside it, ``measured_us``). Times are microseconds per
step (a forward pass after the prompt's).

A layer's row op (``llama_row``, kernels/layer_step.cpp; ``llama_rows`` for every layer of
a step) is one top-level op that calls the layers' linears' kernels and torch's ops from C++: its
kernels go to their format and linear (in its call order, named by its ``mt.row`` label), its
other ops to one part, and its own time between them to another.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter, defaultdict

from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from multitoken.decoding.engine import generate
from multitoken.kernels.cpu_linear import PackedLinear
from multitoken.kernels.fused_linear import FusedLinear

PREFIX = "mt."
KERNEL_OPS = "multitoken_"  # our torch ops' namespaces (multitoken_native, multitoken_avx2, ...)
STEP, GENERATE = "mt.step", "mt.generate"
# module class name (its end) -> label, tried in order: norms before layers ("LayerNorm")
CLASS_LABELS = (("Norm", "mt.norm"), ("RotaryEmbedding", "mt.rotary"), ("Attention", "mt.attention"),
                ("MLP", "mt.mlp"), ("DecoderLayer", "mt.layer"), ("Layer", "mt.layer"))
# innermost label -> the part of the step its ops are counted in
PARTS = {"mt.attention": "attention (scores, softmax, KV cache)", "mt.rotary": "attention (scores, softmax, KV cache)",
         "mt.norm": "norms", "mt.mlp": "MLP activation and product", "mt.embed": "embedding",
         "mt.layer": "residual adds", STEP: "step set-up (mask, positions)", GENERATE: "decoding logic (outside the model)"}
RESIDUE = "Python and dispatch between ops"
# the layer row op (kernels/layer_step.cpp: a step's rows of one sequence): its calls run under ``mt.row:<fmt>:<linear>,...``
# (its four linears in call order) and the ops it calls are split into these parts
ROW, ROW_OPS_NAMES = "mt.row", ("::llama_row", "::llama_rows")  # one layer, every layer
ROW_OPS, ROW_SELF = "layer row op: its torch ops (norms, rotary, attention, adds)", "layer row op: C++ between its ops"
ROW_LINEARS = ("q_proj+k_proj+v_proj", "o_proj", "gate_proj+up_proj", "down_proj")


def label_of(name: str, module: nn.Module) -> str | None:
    """The label a module's calls run under (None: not one of interest)."""
    leaf = name.rsplit(".", 1)[-1] or "model"
    if isinstance(module, PackedLinear):
        return f"mt.linear:{module.format}:{leaf}"
    if isinstance(module, FusedLinear):
        return f"mt.linear:{module.format}:{'+'.join(module.names)}"
    if isinstance(module, nn.Linear):
        return f"mt.linear:stock:{leaf}"
    if isinstance(module, nn.Embedding):
        return "mt.embed"
    cls = type(module).__name__
    return next((label for end, label in CLASS_LABELS if cls.endswith(end)), None)


def _wrap(label: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return run


@contextlib.contextmanager
def labelled(model: nn.Module, extra: dict[str, nn.Module] | None = None):
    """``model``'s modules (and ``extra``: name -> module, e.g. a draft unembedding outside the
    model's tree) called under their labels, and ``model.step`` under ``mt.step``, inside the ``with``."""
    modules = dict(model.named_modules())
    modules.update({f"{name}.{sub}".rstrip("."): m for name, root in (extra or {}).items()
                    for sub, m in root.named_modules()})
    wrapped = []
    for name, module in modules.items():
        label = label_of(name, module)
        if label is None or "forward" in module.__dict__:
            continue
        attrs = ("forward", "argmax") if isinstance(module, PackedLinear) else ("forward",)
        for attr in attrs:
            wrapped.append(_patch(module, attr, label.replace("mt.linear", "mt.argmax") if attr == "argmax" else label))
    if hasattr(model, "step"):
        wrapped.append(_patch(model, "step", STEP))
    wrapped += _lean_labels(model)
    try:
        yield
    finally:
        for obj, attr, before in reversed(wrapped):
            if before is _ABSENT:
                obj.__dict__.pop(attr, None)
            else:
                obj.__dict__[attr] = before


_ABSENT = object()


def _patch(obj, attr: str, label: str) -> tuple[object, str, object]:
    """``obj.attr`` called under ``label`` -> (obj, attr, what its ``__dict__`` held there)."""
    before = obj.__dict__.get(attr, _ABSENT)
    obj.__dict__[attr] = _wrap(label, getattr(obj, attr))
    return obj, attr, before


def _lean_labels(model: nn.Module) -> list[tuple[object, str, object]]:
    """The lean layer forward's calls under the labels of the modules it stands for (a layer, its
    norms, rotary and attention, its fused linears; ``lean_layers.py``), on the plans made so far (a profiled run follows
    unprofiled ones): ``_patch``'s triples."""
    lean = getattr(getattr(model, "backbone", None), "lean", None)
    if lean is None:
        return []
    wrapped = [_patch(lean, "run", "mt.layer")]
    rows = [plan.row for plan in lean.plans.values() if plan.row is not None]
    for row in rows:
        wrapped.append(_patch(row, "run", _row_label([row])))
    if lean.stack is not None and lean.stack.op is not None:  # every layer's rows, in layer order
        ordered = {id(plan.layer): plan.row for plan in lean.plans.values()}
        wrapped.append(_patch(lean, "run_rows", _row_label([ordered.get(id(layer)) for layer in lean.stack.layers])))
    for plan in lean.plans.values():
        wrapped += [_patch(plan, attr, label) for attr, label in (("norm", "mt.norm"), ("rotary", "mt.rotary"),
                                                                   ("rotary_one", "mt.rotary"), ("attention", "mt.attention"))]
        for fused in (plan.qkv, plan.gate_up):  # outside the module tree: labelled by their parts
            if fused is not None and "forward" not in fused.__dict__:
                wrapped += [_patch(fused, attr, label_of("", fused)) for attr in ("forward", "joint")]
    return wrapped


def _labels(event) -> list[str]:
    """The labels around ``event``, innermost first; empty where an op (not a label) calls it."""
    out, parent = [], event.cpu_parent
    while parent is not None:
        if not parent.name.startswith(PREFIX):
            return []
        out.append(parent.name)
        parent = parent.cpu_parent
    return out


def _linear(label: str) -> tuple[str, str] | None:
    """(format, linear name) of a linear's or argmax's label, else None."""
    kind, _, rest = label.partition(":")
    if kind not in ("mt.linear", "mt.argmax"):
        return None
    fmt, _, name = rest.partition(":")
    return fmt, name + (" (argmax)" if kind == "mt.argmax" else "")


def _row_label(rows) -> str:
    """``mt.row:<format>:<linear>,...``: the linears the row op of ``rows`` (one or every layer's) calls, in order."""
    return f"{ROW}:" + ",".join(f"{f}:{n}" for row in rows if row is not None for f, n in zip(row.formats(), ROW_LINEARS))


def _row_linear(event, row) -> tuple[str, str]:
    """(format, linear name) of a kernel ``event`` the layer row op ``row`` called: its linears
    in call order, named by the label around ``row``."""
    label = next((x for x in _labels(row) if x.startswith(ROW + ":")), ROW + ":")
    named = [tuple(item.split(":", 1)) for item in label.partition(":")[2].split(",") if ":" in item]
    kernels = sorted((c for c in row.cpu_children if c.name.startswith(KERNEL_OPS)), key=lambda c: c.time_range.start)
    index = next(i for i, c in enumerate(kernels) if c is event)
    return named[index] if index < len(named) else ("unknown", "layer op linear")


def _window(events) -> tuple[int, float, float, int]:
    """(thread, start, end, steps): the run's thread, from the end of its first step to its end."""
    runs = [e for e in events if e.name == GENERATE]
    if len(runs) != 1:
        raise ValueError(f"expected one {GENERATE} label in the profile, found {len(runs)}")
    run = runs[0]
    steps = sorted((e for e in events if e.name == STEP and e.thread == run.thread), key=lambda e: e.time_range.start)
    if len(steps) < 2:
        raise ValueError("the run made no step after the prompt's pass: ask for more new tokens")
    return run.thread, steps[0].time_range.end, run.time_range.end, len(steps) - 1


def attribute(events) -> dict:
    """Microseconds per step by part of the step (see the module doc) from a profile's events."""
    thread, start, end, steps = _window(events)
    inside = [e for e in events if e.thread == thread and e.time_range.start >= start and e.time_range.end <= end]
    parts: Counter = Counter()
    formats: Counter = Counter()
    linears: dict[str, Counter] = defaultdict(Counter)
    counts = Counter()
    wrappers = 0.0  # the linears' labelled time less their ops': their Python wrappers
    for e in inside:
        span = e.time_range.end - e.time_range.start
        if e.name.startswith(PREFIX):
            if _linear(e.name) is not None:
                wrappers += span
            continue
        counts["ops"] += 1
        labels = _labels(e)
        row = e.cpu_parent if e.cpu_parent is not None and e.cpu_parent.name.endswith(ROW_OPS_NAMES) else None
        if not labels and row is None and e.cpu_parent is not None:
            continue  # nested in another op: its caller's time holds it
        if row is None:
            counts["top_level_ops"] += 1
        if e.self_cpu_memory_usage > 0:
            counts["allocating_ops"] += 1
            counts["allocated_bytes"] += e.self_cpu_memory_usage
        if row is not None:  # an op the layer row op called: its linears' kernels, else its torch ops
            if e.name.startswith(KERNEL_OPS):
                fmt, name = _row_linear(e, row)
                formats[fmt] += span
                linears[name][fmt] += span
                parts[f"linear kernels: {fmt}"] += span
            else:
                parts[ROW_OPS] += span
            continue
        if e.name.endswith(ROW_OPS_NAMES):  # the op itself: only its time between the ops it called
            parts[ROW_SELF] += span - sum(c.time_range.end - c.time_range.start for c in e.cpu_children)
            continue
        linear = next((found for label in labels if (found := _linear(label)) is not None), None)
        if linear is not None:
            wrappers -= span
            fmt, name = linear
            if e.name.startswith(KERNEL_OPS):
                formats[fmt] += span
                linears[name][fmt] += span
                parts[f"linear kernels: {fmt}"] += span
            else:
                parts["linear (other ops: torch's linear, bias, copies)"] += span
            continue
        part = next((PARTS[label] for label in labels if label in PARTS), PARTS[GENERATE])
        parts[part] += span
    wall = end - start
    ops = sum(parts.values())
    parts["Python in the linears' wrappers"] = max(wrappers, 0.0)
    parts["Python and dispatch elsewhere"] = max(wall - ops - parts["Python in the linears' wrappers"], 0.0)
    per = lambda x: round(x / steps, 1)
    return {"steps": steps, "wall_us": per(wall), "ops_us": per(ops), "residue_us": per(wall - ops),
            "parts_us": {k: per(v) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
            "kernels_by_format_us": {k: per(v) for k, v in formats.items()},
            "kernels_by_linear_us": {name: {k: per(v) for k, v in by.items()} for name, by in sorted(linears.items())},
            "ops_per_step": per(counts["ops"]), "top_level_ops_per_step": per(counts["top_level_ops"]),
            "allocating_ops_per_step": per(counts["allocating_ops"]),
            "allocated_kb_per_step": round(counts["allocated_bytes"] / 1024 / steps, 1)}


def profile_run(model, ids, cfg, table=None, extra: dict[str, nn.Module] | None = None) -> tuple[dict, object]:
    """One ``generate`` of ``ids`` under the profiler, labelled -> (``attribute``'s dict, its result)."""
    with labelled(model, extra), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(GENERATE):
            result = generate(model, ids, cfg, table=table)
    found = attribute(prof.events())
    found["tokens_per_forward"] = round(result.trace.tokens_per_forward, 3)
    return found, result


def measured_us(trace) -> float:
    """An unprofiled run's wall time per step after the prompt's pass (microseconds)."""
    steps = max(trace.forward_passes - 1, 1)
    return round((trace.wall_s - trace.prefill_s) / steps * 1e6, 1)


def draft_unembeddings(model) -> dict[str, nn.Module]:
    """The model's draft unembeddings built so far (outside its module tree), by a name."""
    built = model.__dict__.get("_draft_unembeds", {})
    return {f"draft_unembed{i}": m for i, m in enumerate(built.values())}


def formats(model: nn.Module) -> dict[str, int]:
    """How many of the model's linears run in each format (``stock``: not packed)."""
    found = Counter(label_of(name, m).split(":")[1] for name, m in model.named_modules() if isinstance(m, nn.Linear | PackedLinear))
    return dict(sorted(found.items()))
