"""The codebase keeps its shape: small functions and modules, and a layered import graph in
framework/: no module imports, directly or not, a module that imports it, counting imports
inside functions and the package `__init__` every import runs first; and every import points
down the layers of docs' design (a deferred import, for start-up time, may point down only)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import ROOT

FRAMEWORK = ROOT / "framework"

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 350
MAX_PARAMETERS = 6  # self and cls not counted; a dataclass's generated __init__ is not in the source

# The command paths users type (`python -m framework.evaluate`, ...): each only hands its argv to
# its door in framework/doors/ (test_the_doors_live_in_their_wing)
DOOR_SHIMS = ("framework.evaluate", "framework.generate", "framework.harness", "framework.report",
              "framework.export", "framework.plan.__main__")  # fmt: skip

# The layers, bottom first: a module may import its own layer's modules and those below.
# A module's layer is that of the longest prefix listed.
LAYERS: list[tuple[str, ...]] = [
    # config's schemas, resolvers and run id; the machine; one-concern modules the parts share
    (
        "config.errors",
        "config.schema",
        "config.choices",
        "config.data_schema",
        "config.parallel_schema",
        "config.model_schema",
        "config.memory_schema",
        "config.resolve",
        "config.run_id",
        "machine",
        "dist",
        "contract",
        "loss",
        "tracking",
        "precision",
        "modules",
        "peft",
        "moe",
        "hf",
        "components",  # the component protocol: a choice is a `_target_` class and its kwargs
        "optimizers",  # the optimizer components (Muon), the step in backward, the skipped update
        "schedules",  # the LR schedule components (warm-up + cosine, WSD)
        "figures",
        "hooks",  # the callbacks' contract: hooks, Control, Run (validation reads it)
        "converters",  # model converters (peft=lora's adapters, the converters group), at one point of the build
    ),  # fmt: skip
    # the measure wing: what a run measures and how it counts (FLOPs, memory, collectives, peaks)
    ("measure",),
    # the checkpoint wing: step folders, save and load, digests, resume, the run folder's lock;
    # export's library (a checkpoint to Hugging Face files), which the trainer calls at the end
    ("checkpoint",),
    # the parts, with their own checks (ParallelDims, the data checks); the memory levers parallelize applies
    ("parallel", "data", "levers"),
    # validation, which asks the parts' checks
    ("config",),
    # the planner: a pure function of the config, the model's shapes and the machine
    ("plan",),
    # the callbacks: what watches or changes a step (evaluation, the non-finite check, the model's
    # step protocol, mixtures, the progress bar, the profiler, the loggers, the user's)
    ("callbacks",),
    # the run wing: one rank's run
    ("run",),
    # the front doors' wing (train.py's launch, evaluate, generate, harness, plan, export, report;
    # compose for tests and benchmarks, the forkserver's preload) and the command paths users type,
    # each a shim of its door (DOOR_SHIMS)
    ("doors", *(shim.removeprefix("framework.") for shim in DOOR_SHIMS)),
]

# Exemptions: an edge or a size that must wait for a later change is named here, with the issue
# that removes it.
PENDING_UPWARD: set[tuple[str, str]] = set()
PENDING_SIZE: set[str] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in FRAMEWORK.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Framework modules that importing `name` runs: every import statement in it, at module level
    or inside a function (a deferred import still needs its target when it runs), and for
    `a.b.c` each package on the way (`a.b`'s `__init__` runs first), except this module's own
    packages (already running when it is imported)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level-1
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in modules and dep != name and not name.startswith(dep + "."):
                    found.add(dep)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, as the strongly connected components of more than one module (Tarjan),
    each sorted, the list sorted: no cycle gives []."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


def layer_of(module: str) -> int:
    short = module.removeprefix("framework.")
    best = max(
        ((len(prefix), layer) for layer, prefixes in enumerate(LAYERS) for prefix in prefixes
         if short == prefix or short.startswith(prefix + ".")),
        default=None,
    )  # fmt: skip
    assert best is not None, f"{module}: in no layer of LAYERS; add it where it belongs"
    return best[1]


def upward_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, deps in graph.items() for b in deps if layer_of(b) > layer_of(a)}


def test_framework_import_graph_has_no_cycles():
    found = cycles(import_graph())
    assert not found, f"{len(found)} import cycle(s): " + "; ".join(" <-> ".join(c) for c in found)


def test_every_import_points_down_the_layers():
    up = upward_edges(import_graph()) - PENDING_UPWARD
    assert not up, "imports pointing up the layers: " + ", ".join(f"{a} -> {b}" for a, b in sorted(up))


def test_the_graph_sees_function_local_imports_and_package_inits():
    """The check itself: a deferred import is an edge, and importing a submodule runs its package."""
    graph = import_graph()
    assert "framework.run.trainer" in graph["framework.doors.launch"]  # launch imports the trainer inside a function
    assert "framework.config" not in graph["framework.config.validate"]  # its own package: already running
    # importing framework.parallel.dims runs framework.parallel's __init__ first
    assert {"framework.parallel", "framework.parallel.dims"} <= graph["framework.config.validate"]
    assert cycles({"a": {"b.c"}, "b.c": set(), "b": {"b.d"}, "b.d": {"a"}}) == []  # b.c alone
    assert cycles({"a": {"b", "b.c"}, "b.c": set(), "b": {"b.d"}, "b.d": {"a"}}) == [["a", "b", "b.d"]]
    two = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}}
    assert cycles(two) == [["a", "b"], ["c", "d", "e"]]  # counted one by one
    assert layer_of("framework.plan.profile") == layer_of("framework.plan") < layer_of("framework.plan.__main__")
    assert layer_of("framework.plan.__main__") == layer_of("framework.doors.plan") == layer_of("framework.evaluate")
    # the wings: measure/ and checkpoint/ below the parts, run/ above the planner, the front doors on top
    assert layer_of("framework.measure.memory") < layer_of("framework.parallel") < layer_of("framework.run.trainer")
    assert layer_of("framework.checkpoint.store") < layer_of("framework.plan") < layer_of("framework.run.step")
    assert layer_of("framework.run.sweep") < layer_of("framework.doors.launch")
    assert upward_edges({"framework.dist": {"framework.run.trainer"}, "framework.run.trainer": {"framework.dist"}}) == {
        ("framework.dist", "framework.run.trainer")
    }


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return [n for n in names if n not in ("self", "cls")]


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function, nested ones and methods included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from functions(node, name + ".")
        else:
            yield from functions(node, prefix)


def size_faults(path: Path) -> dict[str, str]:
    """What in one file crosses the limits: {"file" or "file:qualified.function": why}."""
    source = path.read_text()
    where = str(path.relative_to(ROOT))
    faults = {}
    if source.count("\n") > MAX_MODULE_LINES:
        faults[where] = f"{source.count(chr(10))} lines"
    for name, node in functions(ast.parse(source)):
        lines, params = node.end_lineno - node.lineno + 1, len(parameters(node))
        if lines > MAX_FUNCTION_LINES or params > MAX_PARAMETERS:
            faults[f"{where}:{name}"] = f"line {node.lineno}: {lines} lines, {params} parameters"
    return faults


def test_functions_and_modules_stay_small():
    faults = {}
    for path in sorted(FRAMEWORK.rglob("*.py")):
        faults |= size_faults(path)
    over = {k: v for k, v in faults.items() if k not in PENDING_SIZE}
    assert not over, (
        f"over {MAX_FUNCTION_LINES} lines, {MAX_PARAMETERS} parameters or a {MAX_MODULE_LINES}-line module: {over}"
    )


def test_the_size_check_counts_what_it_says(tmp_path):
    long_body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = (
        "class A:\n    def method(self, a, b, c, d, e, f):\n        pass\n"  # 6, self aside: fine
        "def many(a, b, c, d, *args, e, **kw):\n    pass\n"  # 7
        f"def long():\n{long_body}"  # 61 lines
    )
    path = ROOT / "framework" / "_shape_probe.py"
    path.write_text(source)
    try:
        faults = size_faults(path)
    finally:
        path.unlink()
    assert set(faults) == {"framework/_shape_probe.py:many", "framework/_shape_probe.py:long"}
    assert "framework/_shape_probe.py:A.method" not in faults


# ----------------------------------------------------------------------------- the rooms


# the capabilities the loop's files leave to callbacks and the step protocol
FEATURES = (r"moe|experts?|routed|routing|lora|peft|sources|mixtures?|evals?|evaluat[a-z]*|val|patience|monitor|"
            r"profiler|tqdm|progress|wandb|tensorboard|spikes?|stragglers?|checksums?|goodput|bitflip")  # fmt: skip
# a feature word alone or as a part of an identifier: starting after no letter or at a camel hump,
# ending where its word ends, by its case: a lowercase end before no lowercase letter, a capital end
# before no letter or at a camel hump (moe_shape, routed_figures, expertBias, MoELayer, EVAL_STEPS;
# not interval, value, MAX_VALUE, VALID, PROGRESSIVE)
WORD_END = r"(?:(?<=[a-z])(?![a-z])|(?<=[A-Z])(?:(?![A-Za-z])|(?=[A-Z][a-z])))"
FEATURE_WORD = re.compile(rf"(?:(?<![A-Za-z])|(?<=[a-z0-9])(?=[A-Z]))(?i:{FEATURES}){WORD_END}")


def feature_words(text: str) -> list[str]:
    return sorted({m.group(0).lower() for m in FEATURE_WORD.finditer(text)})


def test_the_run_files_name_no_feature():
    """The loop's files name no capability: those are callbacks and the contract's step protocol."""
    files = [ROOT / "framework" / "run" / f"{n}.py" for n in ("trainer", "step", "ledger", "summary", "build")]
    files.append(ROOT / "framework" / "doors" / "report_table.py")
    found = {f.name: feature_words(f.read_text()) for f in files}
    assert not any(found.values()), found


def test_the_feature_check_sees_the_words_inside_identifiers():
    named = "moe_shape routed_figures expert_bias lora_rank self.wandb MoELayer buildMoe EVAL_STEPS evaluation x.val2"
    assert feature_words(named) == ["eval", "evaluation", "expert", "lora", "moe", "routed", "val", "wandb"]
    assert feature_words("interval value Value retrieval progressive removed resource unmonitored") == []
    assert feature_words("MAX_VALUE VALID PROGRESSIVE INTERVAL MoEs EVALUE") == []  # capitals read as capitals
    plurals = "evals n_mixtures EVALS run_evals MixturesOf MOE_LAYER VAL_LOSS"
    assert feature_words(plurals) == ["evals", "mixtures", "moe", "val"]


def models_imported(tree: ast.AST) -> set[str]:
    """The models/ modules a models/ file imports: `from models.X import`, `import models.X`,
    `from models import X` and the relative forms (`from .X import`, `from . import X`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("models.")}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:  # relative: models' own package
                module = f"models.{module}" if module else "models"
            if module == "models":
                found |= {a.name for a in node.names}
            elif module.startswith("models."):
                found.add(module.split(".")[1])
    return found


def test_models_have_no_import_circle():
    """models/ import one another downwards only (llama and moe both take the SwiGLU from swiglu)."""
    graph = {path.stem: models_imported(ast.parse(path.read_text())) for path in (ROOT / "models").glob("*.py")}

    def reaches(a: str, b: str, seen: frozenset = frozenset()) -> bool:
        return any(d == b or (d not in seen and reaches(d, b, seen | {d})) for d in graph.get(a, ()))

    circles = sorted(m for m in graph if reaches(m, m))
    assert not circles, circles
    forms = "import models.a\nimport models.b.c as c\nfrom models.d import x\nfrom models import e\nfrom .f import y\n"
    assert models_imported(ast.parse(forms + "from . import g\nimport torch.models\n")) == set("abdefg")


def test_export_asks_the_model_contract_and_imports_no_model():
    """Hugging Face export reads the names, layout changes and config.json from what the model
    declares (the contract's hf_entries, to_hf_name, hf_config): no model's module, name or class."""
    for path in (FRAMEWORK / "checkpoint" / "export.py", FRAMEWORK / "doors" / "export.py"):
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
        assert not [m for m in imported if m.split(".")[0] == "models"], (path.name, sorted(imported))
        assert not re.search(r"models\.llama|LlamaArgs|\bLlama\(", path.read_text()), path.name
    # the library reads no data either: the door (or the trainer) hands it the run's tokenizer
    assert not {d for d in import_graph()["framework.checkpoint.export"] if d.startswith("framework.data")}


def test_the_doors_live_in_their_wing():
    """Every front door is in framework/doors/; a command path users type stays as a shim that
    imports its own door and nothing else, so no door's code lives beside the wings. A module of
    the top layer outside framework/doors/ is one of those shims."""
    graph = import_graph()
    top = max(layer_of(m) for m in graph)
    for module, deps in graph.items():
        if layer_of(module) != top or module.startswith("framework.doors"):
            continue
        assert module in DOOR_SHIMS, f"{module}: a door outside framework/doors/"
        door = "framework.doors." + module.removeprefix("framework.").removesuffix(".__main__")
        assert deps == {"framework.doors", door}, f"{module} imports {sorted(deps)}: a shim imports its door only"
        assert _modules()[module].read_text().count("\n") <= 10, f"{module}: a shim, not a door"
    assert all(layer_of(d) < top for m, deps in graph.items() if layer_of(m) < top for d in deps)


# Groups whose choices are components (framework/components.py): no layer reads their choice's name
# (a component answers for itself: its checks, its build, its price). Phase 6 moves the other
# groups here one by one (issue 66: memory, precision; converters).
COMPONENT_GROUPS = ("optim", "schedule")
NAME_READING_LAYERS = ("config", "parallel", "plan", "run", "measure")


def choice_name_reads(source: str, groups: tuple[str, ...] = COMPONENT_GROUPS) -> list[str]:
    """`<group>.name`, `<group>.get("name")` and `<group>["name"]` reads in `source`."""
    alternatives = "|".join(groups)
    pattern = rf"\b({alternatives})(\.name\b|\.get\(\s*['\"]name['\"]|\[\s*['\"]name['\"]\s*\])"
    return [m.group(0) for m in re.finditer(pattern, source)]


def test_no_layer_branches_on_a_component_choice_s_name():
    reads = {}
    for layer in NAME_READING_LAYERS:
        for path in sorted((FRAMEWORK / layer).rglob("*.py")):
            if found := choice_name_reads(path.read_text()):
                reads[str(path.relative_to(ROOT))] = found
    assert not reads, f"a layer reads a component group's choice by name: {reads}"


def test_the_name_check_sees_each_form_of_the_read():
    source = 'if cfg.optim.name == "adamw": pass\nx = cfg.schedule.get("name")\ny = optim["name"]\nz = cfg.optim.lr'
    assert choice_name_reads(source) == ["optim.name", 'schedule.get("name"', 'optim["name"]']


# ----------------------------------------------------------------------------- the map


# docs/layout.md's tree: a line starting left of this column is an entry (a name, then what it
# holds); a line starting at it continues the entry above
LAYOUT_DESCRIPTION_COLUMN = 22


def layout_entries(text: str) -> list[tuple[str, str, str]]:
    """docs/layout.md's tree as (folder, name, text) entries: the path of the folder an entry sits
    in ("" at the top, "framework/run/" for trainer.py), the entry's name (what its line gives
    before the description: `trainer.py`, `run/`, `progress.py, profiler.py, loggers.py`) and its
    whole text, continuation lines joined; comment lines (`# the components ...`) dropped."""
    tree = re.search(r"```\n(.*?)```", text, re.S)[1]
    entries: list[list] = []  # [folder, name, text]
    folders: list[tuple[int, str]] = []  # the open folders: (indent, path)
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if indent >= LAYOUT_DESCRIPTION_COLUMN and entries:
            entries[-1][2] += " " + line.strip()
            continue
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else ""
        name = line.strip().split("  ")[0]
        if name.endswith("/"):
            folders.append((indent, parent + name))
        entries.append([parent, name, line.strip()])
    return [(folder, name, text) for folder, name, text in entries]


def layout_names(entries: list[tuple[str, str, str]]) -> tuple[set[str], set[str]]:
    """(the files the tree names, the paths its entries' names give). A file is named in the text
    its folder owns: the folder's own entry and its files' entries, not its subfolders' (under
    framework/run/, `trainer.py`; under framework/, `plan/__main__.py`), as a path from there."""
    owned: dict[str, str] = {}
    entry_paths = set()
    for folder, name, text in entries:
        here = folder + name if name.endswith("/") else folder
        owned[here] = owned.get(here, "") + " " + text
        entry_paths |= {folder + n for n in name.split(", ")}
    token = re.compile(r"(?<![\w./])((?:\w+/)*\w+\.py)(?!\w)")
    named = {folder + m for folder, text in owned.items() for m in token.findall(text)}
    return named, entry_paths


def documented_modules() -> set[str]:
    """Every module of framework/ and models/, as its path from the repository root; a package's
    `__init__.py` only where it defines something (one that re-exports is its folder's entry)."""
    out = set()
    for path in [*FRAMEWORK.rglob("*.py"), *(ROOT / "models").rglob("*.py")]:
        if path.name == "__init__.py":
            body = ast.parse(path.read_text()).body
            if not any(isinstance(n, ast.FunctionDef | ast.ClassDef) for n in body):
                continue
        out.add(str(path.relative_to(ROOT)))
    return out


def test_the_layout_names_every_module():
    """docs/layout.md names every module of framework/ and models/ in its folder's entry, and each
    name its tree gives is a file or folder that exists."""
    named, entry_paths = layout_names(layout_entries((ROOT / "docs" / "layout.md").read_text()))
    missing = sorted(documented_modules() - named)
    assert not missing, f"modules docs/layout.md does not name (add each under its folder): {missing}"
    stale = sorted(p for p in entry_paths if not (ROOT / p).exists())
    assert not stale, f"docs/layout.md names what is not there: {stale}"


def test_the_layout_check_reads_the_tree_as_drawn():
    tree = (
        "```\n"
        "train.py              the entrypoint\n"
        "framework/\n"
        "  run/                one rank's run\n"
        "    trainer.py        the loop\n"
        "  plan/               the planner: model.py (state),\n"
        "                      search.py (parallel=auto)\n"
        "  # a comment names nothing: hooks.py\n"
        "  evaluate.py, plan/__main__.py\n"
        "                      shims; (library: checkpoint/export.py)\n"
        "models/               gpt.py\n"
        "```\n"
    )
    named, entry_paths = layout_names(layout_entries(tree))
    assert named == {"train.py", "framework/run/trainer.py", "framework/plan/model.py", "framework/plan/search.py",
                     "framework/evaluate.py", "framework/plan/__main__.py", "framework/checkpoint/export.py",
                     "models/gpt.py"}  # fmt: skip
    assert "framework/trainer.py" not in named and "framework/model.py" not in named  # a subfolder's names stay its own
    assert {"framework/evaluate.py", "framework/plan/__main__.py", "framework/run/trainer.py"} <= entry_paths
