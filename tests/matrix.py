"""The compatibility matrix's axes, generated from the config schema and conf/ (tests/test_matrix.py).

- strategies: every conf/parallel/*.yaml but `auto` (the planner picks one of the others); each
  strategy's own knobs among KNOBS (its schema's own fields: a bool both ways, a Choice every
  member, `version` 1 and 2) in every combination; a schema made of several strategies (hybrid)
  instead takes every pair of the mesh's degree axes at 2 (world 4). A strategy without a schema
  of its own (none, dp) runs one process, the others two.
- models: every conf/model/*.yaml but a preset of another (gpt_smoke extends gpt), each MODEL_KNOBS
  field of its schema both ways (llama's tie_embeddings) and MODEL_VARIANTS (llama with routed
  experts), at its smallest shape (SHAPES; a new
  model without an entry runs its defaults) on the first data its class declares (`trains_on`;
  none declared: the contract's language-model data).
- features: every non-default choice of FEATURE_GROUPS (precision, memory, peft) and the top-level
  features of TOP_FEATURES, beside the plain run.

A cell is (model, strategy, feature); `subset_cells` is the default suite's covering subset.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from tests.helpers import CONF

STEPS, GLOBAL_BATCH = 4, 8
BASE = ["logger=none", "progress=false", f"steps={STEPS}", "backend.timeout_s=120"]
SKIP_STRATEGIES = {"auto": "the planner: it runs one of the other strategies"}
KNOBS = ("version", "reshard_after_forward", "sequence_parallel", "loss_parallel", "schedule")
INT_KNOBS = {"version": (2, 1)}  # validate.py's allowed FSDP versions (the default first)
MODEL_KNOBS = ("tie_embeddings",)
# rows of a model beside its knobs': a Llama with routed experts, dropless, bias balancing (its loads
# summed over every rank, so every strategy routes as one process does); a Llama with the other
# families' options at once (Qwen2's biases, Qwen3's q/k norms and a head width of 16 where
# dim / n_heads is 8, Mistral's window, shorter than the sequence). At a head width of 12 its amp
# cell under tp with sequence parallel read 26x its floor (1.4e-5, from the first step's loss;
# fp32: bitwise equal): bf16 rounding on the shards' narrower widths, which no one-process
# reordering measures
MODEL_VARIANTS = {
    "llama": [
        ("llama(moe)", ("model.moe.experts=4", "model.moe.top_k=2")),  # the defaults: aux_loss, global
        ("llama(qwen,mistral)", ("model.qkv_bias=true", "model.qk_norm=true", "model.head_dim=16",
                                 "model.sliding_window=8")),
    ]
}  # fmt: skip
FEATURE_GROUPS = ("precision", "memory", "peft", "optim", "converters")
# the one-process reference runs the same choice (a converter's floor too: tests/matrix_run.py `numerics`)
REFERENCED_GROUPS = ("precision", "peft", "optim", "converters")
# {model choice: overrides for its smallest shape}; {hf} and {user} are the test's folders
SHAPES = {
    "gpt": ["model.n_layer=4", "model.n_head=2", "model.n_embd=32"],
    "llama": ["model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=64"],
    "hf": ["model.config={hf}"],
    "custom": ["model._target_=matrix_user.TinyLM", "+model.dim=32", "+model.n_layers=4", "+model.n_heads=2"],
    "mlp": ["model.hidden=32"],
    # resnet trains on its defaults (AdamW): Adam turns reordered sums of near-zero gradients into
    # whole steps (1e-3 by step 4), and its floor, measured on the same optimizer, grows with them
    "lstm": ["model.embed_dim=16", "model.hidden=16"],
}
DATA_SHAPES = {
    "text": ["data.seq_len=16", "data.max_bytes=20000"],
    "images": ["data.image_size=8"],
    "varlen": ["data.max_len=16"],
}
# A cell's bound is a multiple of a measured noise floor (tests/matrix_run.py `floors`), not a
# constant: per model and precision, one process's training summed in another order (its batch's
# samples reversed; and, where no layer reads the whole micro-batch, its global batch as two
# accumulated micro-batches, summed as data parallel's two halves and their all-reduce sum them),
# its worst relative loss difference over the steps. Kernels of another CPU (AVX2, AVX-512, AMX)
# move the floor and the cells alike. A floor is never taken below float32's unit roundoff (the
# loss and the sums are float32 in every precision; a reordering that happens to round alike
# measures 0). A planted bug moves the losses by 100-10,000x the floor (make sabotage's matrix rows).
FLOOR_MULTIPLE = 20
FLOOR_AT_LEAST = 2.0**-24
BATCH_STATISTICS = {"resnet"}  # BatchNorm: half a batch's statistics are another model, not another order
# a choice that needs more than itself to run (the compiler's budget is compile's; the one-process
# reference runs eager): a cell on its defaults as conf/ gives them (a one-line refusal) and a cell
# with the setting, each named by what it sets
CHOICE_SETTINGS: dict[str, tuple[str, ...]] = {"memory=budget": ("compile=true",)}


@dataclass(frozen=True)
class Value:
    """One value of an axis: its name in the table, its overrides, and (strategies) its world
    size; (features) the overrides its single-process reference shares (precision, the split)."""

    name: str
    overrides: tuple[str, ...] = ()
    world: int = 1
    reference: tuple[str, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Cell:
    model: Value
    strategy: Value
    feature: Value

    @property
    def id(self) -> str:
        return f"{self.model}|{self.strategy}|{self.feature}"

    @property
    def precision(self) -> str:
        found = [o.split("=", 1)[1] for o in self.feature.overrides if o.startswith("precision=")]
        return found[0] if found else "fp32"


def conf_choices(group: str) -> list[str]:
    """The choices of a conf/ group that are not a preset of another (a preset names a sibling in
    its defaults, as gpt_smoke names gpt)."""
    names = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    return [n for n in names if not set(_defaults(CONF / group / f"{n}.yaml")) & set(names)]


def _defaults(path: Path) -> list[str]:
    entries = (yaml.safe_load(path.read_text()) or {}).get("defaults", [])
    return [e for e in entries if isinstance(e, str)]


def default_choice(group: str) -> str:
    for entry in (yaml.safe_load((CONF / "config.yaml").read_text()) or {})["defaults"]:
        if isinstance(entry, dict) and group in entry:
            return entry[group]
    raise KeyError(group)


def _knob_values(schema: type, name: str) -> list:
    """A knob's values from its schema field: a bool both ways, a Choice every member, an int
    knob its allowed values; the default first."""
    from framework.config.choices import Choice

    f = next(f for f in fields(schema) if f.name == name)
    if name in INT_KNOBS:
        return list(INT_KNOBS[name])
    if isinstance(f.default, Choice):
        return [f.default.value, *(m.value for m in type(f.default) if m != f.default)]
    if f.type in ("bool", "bool | None", bool) or isinstance(f.default, bool):
        first = bool(f.default)
        return [first, not first]
    raise TypeError(f"{schema.__name__}.{name}: no values for a {f.type} knob")


def _own_fields(schema: type, names: tuple[str, ...]) -> list[str]:
    own = schema.__dict__.get("__annotations__", {})
    return [n for n in names if n in own]


def _variants(prefix: str, schema: type | None, knobs: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """(name, overrides) of every combination of the schema's own knobs; the default unnamed."""
    own = _own_fields(schema, knobs) if schema is not None else []
    values = [_knob_values(schema, k) for k in own]
    out = []
    for combo in itertools.product(*values):
        settings = [f"{k}={_yaml(v)}" for k, v in zip(own, combo, strict=True)]
        named = [s for s, v, vs in zip(settings, combo, values, strict=True) if v != vs[0]]
        name = f"{prefix.split('.')[0]}({','.join(named)})" if named else prefix.split(".")[0]
        out.append((name, tuple(f"{prefix}.{s}" for s in settings)))
    return out


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# expert parallel (routed experts split over ep of the dp_shard ranks; a dense model is refused):
# over fsdp's 2 ranks, with HSDP (2 replicas of 2 shards, ep inside each), and with context
# parallel (ep over a cp group: both halves of each sequence routed; experts FSDP over dp_shard)
HSDP_EP = ("parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.dp_replicate=2", "parallel.dp_shard=2",
           "parallel.ep=2")  # fmt: skip
CP_EP = ("parallel.tp=1", "parallel.pp=1", "parallel.cp=2", "parallel.dp_replicate=1", "parallel.dp_shard=2",
         "parallel.ep=2")  # fmt: skip
EP_STRATEGIES = [
    Value("fsdp(ep=2)", ("parallel=fsdp", "parallel.ep=2"), world=2),
    Value("hybrid(dp_replicatexep)", ("parallel=hybrid", *HSDP_EP), world=4),
    Value("hybrid(cpxep)", ("parallel=hybrid", *CP_EP), world=4),
]


def strategies() -> list[Value]:
    from framework.config.parallel_schema import MeshConfig
    from framework.config.schema import GROUP_SCHEMAS

    schemas = GROUP_SCHEMAS["parallel"]
    # ep is no axis of the world's product (it borrows dp_shard's ranks): its rows are EP_STRATEGIES
    degrees = [d for d in _own_fields(MeshConfig, tuple(f.name for f in fields(MeshConfig))) if d != "ep"]
    out = []
    for choice in conf_choices("parallel"):
        if choice in SKIP_STRATEGIES:
            continue
        schema, picked = schemas.get(choice), (f"parallel={choice}",)
        if schema is not None and len(schema.__bases__) > 1:  # a combination: each pair of axes at 2
            for pair in itertools.combinations(degrees, 2):
                settings = tuple(f"parallel.{d}={2 if d in pair else 1}" for d in degrees)
                out.append(Value(f"{choice}({'x'.join(pair)})", picked + settings, world=4))
            continue
        world = 1 if schema is None else 2
        for name, settings in _variants("parallel", schema, KNOBS):
            out.append(Value(name.replace("parallel", choice, 1), picked + settings, world=world))
    return out + EP_STRATEGIES


def models() -> list[Value]:
    from framework.config.schema import GROUP_SCHEMAS

    out = []
    for choice in conf_choices("model"):
        shape = [f"model={choice}", *SHAPES.get(choice, [])]
        data = data_of(choice, shape)
        shape += [f"data={data}", *DATA_SHAPES.get(data, [])]
        for name, settings in _variants("model", GROUP_SCHEMAS["model"].get(choice), MODEL_KNOBS):
            out.append(Value(name.replace("model", choice, 1), (*shape, *settings)))
        out += [Value(name, (*shape, *settings)) for name, settings in MODEL_VARIANTS.get(choice, [])]
    return out


def data_of(choice: str, shape: list[str]) -> str:
    """The first data choice the model's class declares it trains on (else language-model data)."""
    import importlib

    from framework.config.schema import GROUP_SCHEMAS
    from framework.contract import LM_DATA

    target = next((o.split("=", 1)[1] for o in shape if o.startswith("model._target_=")), None)
    if target is None:
        target = GROUP_SCHEMAS["model"][choice]._target_
    module, _, name = target.rpartition(".")
    try:
        declared = getattr(importlib.import_module(module), name, None)
    except ImportError:  # the user's module: written by the test later
        declared = None
    return (getattr(declared, "trains_on", None) or LM_DATA)[0]


HF_STREAM = ("data=hf", "data.path={rows}", "data.streaming=true", "data.seq_len=16")
HF_MIXTURE = ("data=hf", "data.sources=[{{path: {rows}, weight: 0.7}}, {{path: {rows2}, weight: 0.3}}]",
              "data.batch_schedule=[[0,4],[2,8]]", "data.seq_len=16")  # fmt: skip
TOP_FEATURES = [
    # the reference accumulates too: a model whose forward reads the whole micro-batch (BatchNorm)
    # computes other statistics on half a batch, in one process as under any strategy
    Value("accumulation_steps=2", ("accumulation_steps=2",), reference=("accumulation_steps=2",)),
    Value("compile=true", ("compile=true",)),
    Value(
        "eval.every=2", ("eval.every=2", "eval.steps=2", "data.val_fraction=0.1"), reference=("data.val_fraction=0.1",)
    ),
    Value("resume at another world size", ("resume",)),
    # data at scale (features that set data= replace the model's data): a streamed Hugging Face
    # dataset; a 0.7/0.3 mixture of two with a batch ramp (4 samples a step, then 8 from step 2)
    Value("data=hf streamed", HF_STREAM, reference=HF_STREAM),
    Value("data.sources, batch ramp", HF_MIXTURE, reference=HF_MIXTURE),
    Value("checkpoint.export=true", ("checkpoint.export=true",)),
    # the optimizer step in backward cannot clip: on the defaults (optim.grad_clip=1.0) a one-line
    # refusal; without clipping, its reference trains without clipping too
    Value("optim.in_backward=true", ("optim.in_backward=true",)),
    Value(
        "optim.in_backward=true, optim.grad_clip=0",
        ("optim.in_backward=true", "optim.grad_clip=0"),
        reference=("optim.grad_clip=0",),
    ),
]


def features() -> list[Value]:
    out = [Value("plain (fp32)")]
    for group in FEATURE_GROUPS:
        for choice in conf_choices(group):
            if choice != default_choice(group):
                name, extra = f"{group}={choice}", CHOICE_SETTINGS.get(f"{group}={choice}", ())
                for setting in ((name,), (name, *extra)) if extra else ((name,),):
                    reference = setting if group in REFERENCED_GROUPS else ()
                    out.append(Value(", ".join(setting), setting, reference=reference))
    return out + TOP_FEATURES


def full_cells() -> list[Cell]:
    """Every model under every strategy (plain), and every feature under every strategy on gpt
    and the tied Llama."""
    ms, ss, fs = models(), strategies(), features()
    table1 = [Cell(m, s, fs[0]) for m in ms for s in ss]
    picked = [m for m in ms if m.name in ("gpt", "llama(tie_embeddings=true)")]
    table2 = [Cell(m, s, f) for m in picked for s in ss for f in fs[1:]]
    return table1 + table2


def all_pairs(axes: list[list]) -> list[tuple]:
    """A covering array of strength 2, greedily: every pair of values of any two axes in some
    row. Each row starts from the first pair still uncovered and fills the other axes with the
    value that covers most uncovered pairs (the first such, so the result is deterministic)."""
    n = len(axes)
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(n), 2)
                 for a in range(len(axes[i])) for b in range(len(axes[j]))}  # fmt: skip
    rows = []
    while uncovered:
        i, a, j, b = min(uncovered)
        row: list[int | None] = [None] * n
        row[i], row[j] = a, b
        for k in range(n):
            if row[k] is None:
                row[k] = max(range(len(axes[k])), key=lambda v, k=k: _gain(row, k, v, uncovered))
        for p, q in itertools.combinations(range(n), 2):
            uncovered.discard((p, row[p], q, row[q]))
        rows.append(tuple(axes[k][row[k]] for k in range(n)))
    return rows


def _gain(row: list, k: int, v: int, uncovered: set) -> int:
    return sum(((min(k, m), v if k < m else row[m], max(k, m), row[m] if k < m else v) in uncovered)
               for m in range(len(row)) if m != k and row[m] is not None)  # fmt: skip


def family(strategy: Value) -> str:
    """A strategy's family: its parallel choice (`fsdp(version=1)` is an fsdp, `hybrid(tpxpp)` a hybrid)."""
    return strategy.name.split("(")[0]


def subset_cells() -> list[Cell]:
    """The default suite's covering subset: every pair of a model, a strategy family and a feature
    meets in some cell, and each family's cells take its variants (knob settings, hybrid's pairs of
    axes) in turn, so every variant is in some cell too. The full tables are `make matrix`'s."""
    variants: dict[str, list[Value]] = {}
    for strategy in strategies():
        variants.setdefault(family(strategy), []).append(strategy)
    turns = {name: itertools.cycle(values) for name, values in variants.items()}
    cells = [Cell(model, next(turns[name]), feature)
             for model, name, feature in all_pairs([models(), list(variants), features()])]  # fmt: skip
    return cells + [cell for cell in pinned_cells() if cell.id not in {c.id for c in cells}]


# cells kept in the default suite by name: the resnet cell a Sapphire Rapids CPU (AVX-512, AMX) put
# 1.6e-5 off one process under a constant bound (issue 52); amp's loss scaling through a pipeline's
# schedule (the pairs alone meet it only where the scaler's warm-up skips the comparison); a stream's
# padded rows through a pipeline (a mean per micro-batch read 303x the floor from step 3); LoRA under
# sequence parallel (torch's SequenceParallel made the frozen norms trainable: 198x from step 2);
# evaluation under cp x pp (the full matrix found it reading whole sequences into the ring); a
# compiled zero-bubble pipeline (Inductor's in-place buffers read again by the weight pass: 2950x)
PINNED = ("resnet|fsdp(version=1,reshard_after_forward=false)|memory=checkpoint", "gpt|pp|precision=amp",
          "gpt|pp|data=hf streamed", "gpt|tp(sequence_parallel=true)|peft=lora", "gpt|hybrid(ppxcp)|eval.every=2",
          "llama(tie_embeddings=true)|pp(schedule=ZBVZeroBubble)|compile=true")  # fmt: skip


def pinned_cells() -> list[Cell]:
    ms, ss, fs = ({v.name: v for v in values} for values in (models(), strategies(), features()))
    return [Cell(ms[m], ss[s], fs[f]) for m, s, f in (name.split("|") for name in PINNED)]
