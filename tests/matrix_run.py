"""The matrix's runs: each cell composed and validated in this process (a refusal is its outcome),
the rest trained in groups of workers of each world size (a fresh group every GROUP_CONFIGS
configs), after the single-process references and the noise floors' runs (tests/test_matrix.py,
tests/matrix.py's FLOOR_MULTIPLE). A config that raises ends its group: the configs before it are
done, it is recorded as FAILED, and a fresh group runs the ones after it, so one failure hides no
other cell.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from tests.helpers import KERNEL_VARIABLES, on_cpu, read_metrics, write_tiny_llama_config
from tests.matrix import (
    BASE,
    BATCH_STATISTICS,
    CHOICE_SETTINGS,
    FLOOR_AT_LEAST,
    FLOOR_MULTIPLE,
    GLOBAL_BATCH,
    STEPS,
    Cell,
)

SAVED_AT = 2  # a resumed cell's checkpoint: after this many steps, at another world size
# configs one group of workers trains before a fresh group takes the rest: each run's process
# groups keep their Gloo threads past destroy_process_group (held in C++ after FSDP and TP runs),
# and a worker with thousands of them trains each config slower than the last (1-2 s a cell at
# first, 12-90 s after 300)
GROUP_CONFIGS = 40
REVERSED = "-reversed"  # a floor's run whose every batch has its samples in reverse order
HALVES = "-halves"  # a floor's run whose BatchNorm statistics are two halves' combined, as over 2 ranks


def prepare(folder: Path) -> dict[str, str]:
    """The folders SHAPES names: a tiny Hugging Face config, and the user's model module
    (importable here and in the workers, which start with this sys.path)."""
    from tests.test_own_model import TINY

    hf = write_tiny_llama_config(folder / "hf", num_hidden_layers=4)
    rows = write_rows(folder / "rows", 160, "parquet")
    rows2 = write_rows(folder / "rows2.jsonl", 80, "json")
    user = folder / "user"
    user.mkdir(exist_ok=True)
    (user / "matrix_user.py").write_text(TINY)
    if str(user) not in sys.path:
        sys.path.insert(0, str(user))
    return {"hf": str(hf), "user": str(user), "rows": str(rows), "rows2": str(rows2)}


def write_rows(path: Path, n: int, fmt: str) -> Path:
    """Rows of text for data=hf: a parquet folder of two files, or a JSON-lines file."""
    import json

    texts = [f"row {i}: " + "the quick brown fox jumps over the lazy dog "[: 8 + i % 30] for i in range(n)]
    if fmt == "json":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(exist_ok=True)
    for k in range(2):
        pq.write_table(pa.table({"text": texts[k::2]}), path / f"part-{k}.parquet")
    return path


def _fill(overrides, folders: dict[str, str]) -> list[str]:
    return [o.format(**folders) for o in overrides]


def compose_cell(overrides: list[str], world: int) -> dict[str, Any]:
    """Composed and validated for `world` workers, each data-parallel rank's micro-batch set so the
    global batch is GLOBAL_BATCH (as train.py would; raises ConfigError for a refusal)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    from framework.config import compose, validate
    from framework.config.model import model_dims_of
    from framework.parallel.dims import DimsError, ParallelDims

    cfg = compose(on_cpu([*BASE, *overrides, f"launch.nproc_per_node={world}"]))
    try:
        dp = ParallelDims.from_config(cfg.parallel, world, *model_dims_of(cfg)).dp
    except (DimsError, InterpolationResolutionError):
        dp = 1  # validation names the problem (a model that does not take this data: its keys do not resolve)
    cfg.data.batch_size = max(1, GLOBAL_BATCH // (dp * cfg.accumulation_steps))
    validate(cfg)
    return OmegaConf.to_container(cfg, resolve=True)


def cell_overrides(cell: Cell, folders: dict[str, str]) -> list[str]:
    feature = [o for o in cell.feature.overrides if o != "resume"]
    return _fill([*model_part(cell), *cell.strategy.overrides, *feature], folders)


def reference_overrides(cell: Cell, folders: dict[str, str]) -> list[str]:
    return _fill([*model_part(cell), "parallel=none", *cell.feature.reference], folders)


def model_part(cell: Cell) -> list[str]:
    """The model's overrides; its data's only where the feature sets no data of its own."""
    own_data = any(o.startswith("data=") for o in cell.feature.overrides)
    return [o for o in cell.model.overrides if not (own_data and o.startswith("data"))]


def floor_runs(cell: Cell, folders: dict[str, str]) -> dict[str, list[str]]:
    """{key: overrides} of the runs that measure the noise floor of the cell's model and precision:
    one process on the model's own data, then the same summed in other orders (its samples
    reversed; its global batch as two accumulated micro-batches, but for a model with batch
    statistics, where that is another model)."""
    precision = [] if cell.precision == "fp32" else [f"precision={cell.precision}"]
    precision += [s for p in precision for s in CHOICE_SETTINGS.get(p, ())]
    precision += numerics(cell)
    base = _fill([*cell.model.overrides, "parallel=none", *precision], folders)
    runs = {key_of(base): base, key_of(base) + REVERSED: base}
    if cell.model.name.split("(")[0] in BATCH_STATISTICS:  # the ranks' statistics reduced: sync BatchNorm's order
        runs[key_of(base) + HALVES] = base
    else:
        runs[key_of([*base, "accumulation_steps=2"])] = [*base, "accumulation_steps=2"]
    return runs


def numerics(cell: Cell) -> list[str]:
    """The feature's settings that change the arithmetic (a converter: float8's casts), which its
    floor's runs share: the floor is the model's in that arithmetic."""
    return [o for o in cell.feature.reference if o.lstrip("+").startswith("converters")]


def measured_floor(cell: Cell, out: Path, folders: dict[str, str], errors: dict[str, str]) -> float:
    """The worst relative loss difference, over the steps, of the floor's reordered runs from its
    first (raises with the error of a floor's run that failed)."""
    keys = list(floor_runs(cell, folders))
    failed = [k for k in keys if k in errors]
    if failed:
        raise RuntimeError(f"the noise floor's run failed: {errors[failed[0]]}")
    want = losses(out / keys[0])
    return max(deviation(losses(out / k), want, want) for k in keys[1:])


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


def deviation(got: dict[int, float], want: dict[int, float], steps) -> float:
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)


@contextmanager
def reversed_samples():
    """Every batch the data pipeline prepares with its samples in reverse order (inputs and targets
    alike): the same training, its sums over the batch taken in another order."""
    import torch

    from framework.data import DataPipeline

    prepare = DataPipeline.prepare

    def reverse(self, batch, device, non_blocking=None):
        inputs, target = prepare(self, batch, device, non_blocking)

        def flip(t):
            return t.flip(0) if isinstance(t, torch.Tensor) and t.dim() and t.size(0) == target.size(0) else t

        return tuple(map(flip, inputs)), flip(target)

    DataPipeline.prepare = reverse
    try:
        yield
    finally:
        DataPipeline.prepare = prepare


@contextmanager
def statistics_in_halves():
    """Every training BatchNorm's batch statistics taken over the batch's two halves, then combined
    by their counts (the mean of the means, the variance with the means' spread): the order in
    which data parallel's synchronized BatchNorm reduces them over 2 ranks, in one process."""
    import torch
    import torch.nn.functional as F

    batch_norm = F.batch_norm

    def halves(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
        if not training or x.size(0) < 2:
            return batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
        dims, shape = [0, *range(2, x.dim())], [1, -1] + [1] * (x.dim() - 2)
        x, dtype = x.float(), x.dtype  # statistics in float32, as BatchNorm keeps them under autocast
        parts = [(h.numel() // h.size(1), h.mean(dims), h.var(dims, unbiased=False)) for h in x.chunk(2)]
        n = sum(c for c, _, _ in parts)
        mean = sum(c * m for c, m, _ in parts) / n
        var = sum(c * (v + (m - mean) ** 2) for c, m, v in parts) / n
        if running_mean is not None:
            with torch.no_grad():
                running_mean.lerp_(mean.detach(), momentum)
                running_var.lerp_(var.detach() * n / (n - 1), momentum)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
        return (out if weight is None else out * weight.view(shape) + bias.view(shape)).to(dtype)

    F.batch_norm = halves
    try:
        yield
    finally:
        F.batch_norm = batch_norm


def key_of(overrides: list[str]) -> str:
    return hashlib.sha1("\n".join(overrides).encode()).hexdigest()[:12]


def resumes(cell: Cell) -> bool:
    return "resume" in cell.feature.overrides


def save_plan(cell: Cell, folders: dict[str, str]) -> tuple[list[str], int]:
    """A resumed cell's first part: SAVED_AT steps at another world size (one process for a
    strategy of several; ddp at 2 for one of one process), on the schedule of the whole run."""
    other = ["parallel=none"] if cell.strategy.world > 1 else ["parallel=ddp"]
    extra = [f"steps={SAVED_AT}", f"schedule.steps={STEPS}", f"checkpoint.every={SAVED_AT}"]
    return _fill([*model_part(cell), *cell.feature.reference], folders) + other + extra, (
        1 if cell.strategy.world > 1 else 2
    )


def run_batch(configs: dict[str, dict], world: int, out: Path, start_method: str = "forkserver") -> dict[str, str]:
    """Train `configs` in groups of `world` workers; {name: error} of those that raised."""
    from framework.machine import launch_local
    from framework.run.sweep import device_and_backend

    errors: dict[str, str] = {}
    remaining = dict(configs)
    while remaining:
        group = dict(list(remaining.items())[:GROUP_CONFIGS])
        try:
            launch_local(world, _train_batch, group, str(out), device_and_backend(group), start_method=start_method)
            failure = None
        except Exception as err:  # the first config not done ended the group
            failure = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
        done = [n for n in group if (out / n / "done").exists()]
        left = [n for n in remaining if n not in done]
        if failure is not None and left:
            errors[left[0]] = _error_text(out / left[0]) or failure
            left = left[1:]
        elif failure is not None:
            errors.setdefault("(group)", failure)
        remaining = {n: remaining[n] for n in left}
    return errors


def _error_text(run_dir: Path) -> str | None:
    texts = sorted(run_dir.glob("error-rank*.txt")) if run_dir.exists() else []
    return texts[0].read_text().strip().splitlines()[-1] if texts else None


def _train_batch(configs: dict[str, dict], out_dir: str, place: tuple[str, str]) -> None:
    """Each config in turn on this group (as framework.run.sweep's), marking each one done; a
    config that raises writes its error and ends the group."""
    import torch
    from omegaconf import OmegaConf

    from framework.dist import destroy_distributed, init_distributed
    from framework.run.resilience import Guard
    from framework.run.run_files import RunFiles
    from framework.run.trainer import train

    info = init_distributed(*place, timeout_s=120)
    try:
        for name, config in configs.items():
            cfg, run_dir, started = OmegaConf.create(config), Path(out_dir) / name, time.perf_counter()
            torch.manual_seed(cfg.seed)
            reorders = {REVERSED: reversed_samples, HALVES: statistics_in_halves}
            reorder = next((r() for suffix, r in reorders.items() if name.endswith(suffix)), nullcontext())
            try:
                with reorder, Guard(info, cfg.checkpoint.preempt_grace_s) as guard:
                    train(cfg, info, RunFiles(str(run_dir), info), {"parallel": cfg.parallel.name}, guard)
            except BaseException as err:
                run_dir.mkdir(parents=True, exist_ok=True)
                trace = "".join(traceback.format_exception(err))
                (run_dir / f"error-rank{info.rank}.txt").write_text(trace)
                raise
            if info.is_main:
                kernels = {k: os.environ[k] for k in KERNEL_VARIABLES if k in os.environ}
                kernels["aten"] = torch.backends.cpu.get_cpu_capability()
                done = {"seconds": time.perf_counter() - started, "kernels": kernels}
                (run_dir / "done").write_text(json.dumps(done))
    finally:
        destroy_distributed()


def outcome(cell: Cell, run_dir: Path, ref_dir: Path, floor: float) -> tuple[str, str, dict]:
    """("parity", its deviation and floor) or ("FAILED", why) of a cell that ran, and its figures:
    the worst relative loss difference from one process over the steps, the noise floor measured
    for its model and precision, and their ratio (the floor no lower than the unit roundoff)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("status") != "ok":
        return "FAILED", f"status {summary.get('status')}: {summary.get('error')}", {}
    got, want = losses(run_dir), losses(ref_dir)
    steps = range(SAVED_AT + 1, STEPS + 1) if resumes(cell) else range(1, STEPS + 1)
    if sorted(got) != list(steps):
        return "FAILED", f"logged steps {sorted(got)}, expected {list(steps)}", {}
    worst = deviation(got, want, steps)
    figures = {"deviation": worst, "floor": floor, "ratio": worst / max(floor, FLOOR_AT_LEAST),
               "kernels": json.loads((run_dir / "done").read_text())["kernels"]}  # fmt: skip
    measured = f"deviation {worst:.1e}, {figures['ratio']:.3g}x the floor {floor:.1e}"
    if figures["ratio"] > FLOOR_MULTIPLE and (warmup := scale_warmup(cell, run_dir, ref_dir)):
        return "warm-up", warmup, figures
    if figures["ratio"] > FLOOR_MULTIPLE:
        return "FAILED", f"{measured} (bound {FLOOR_MULTIPLE}x): losses {[got[s] for s in steps]} vs one " \
                         f"process {[want[s] for s in steps]}", figures  # fmt: skip
    if "checkpoint.export=true" in cell.feature.overrides and not any(
        (run_dir / f).exists() for f in ("model.pt", "hf")
    ):
        return "FAILED", "checkpoint.export=true wrote neither model.pt nor hf/", figures
    return "parity", f"{measured} (bound {FLOOR_MULTIPLE}x)", figures


def scale_warmup(cell: Cell, run_dir: Path, ref_dir: Path) -> str | None:
    """amp from its default first scale (2^16): where the cell's scaler skipped its first update
    (an overflow, then the scale halves) and one process's did not, and nothing else, the
    explanation; else None. Data parallel's ranks backpropagate dp x the one process's per-token
    gradients (FSDP averages them after), and float16 parameters hold less range than autocast's
    float32 ones: the same scale can overflow under a layout and not alone."""
    if cell.precision != "amp":
        return None
    skipped = [[m["step"] for m in read_metrics(d) if m.get("skipped")] for d in (run_dir, ref_dir)]
    if skipped != [[1], []]:
        return None
    return "the loss scaler's warm-up: this layout's first update overflowed at the default first scale and was skipped, one process's was not"


def refusal(err: Exception) -> tuple[str, str, dict]:
    """A config error is a refusal if it is one line naming its key; anything else FAILED."""
    from framework.config import ConfigError

    text = str(err)
    if isinstance(err, ConfigError) and "\n" not in text and text.startswith(f"{err.key}: "):
        return "refused", text, {}
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return "FAILED", f"{type(err).__name__} while composing: {last}", {}


def run_cells(cells: list[Cell], out: Path, start_method: str = "forkserver") -> dict[str, tuple[str, str, dict]]:
    """{cell id: (outcome, detail, figures)} for every cell: refusals composed here, then the
    references and floors, the resumed cells' saves and the cells in groups of workers of each
    world size. `spawn` starts each group's workers afresh, in this process's environment as it
    is now (forced math kernels: a forkserver keeps the kernels it chose when it started)."""
    folders = prepare(out / "folders")
    results: dict[str, tuple[str, str]] = {}
    planned: dict[int, dict[str, tuple[Cell, list[str]]]] = {}
    refs: dict[str, list[str]] = {}
    saves: dict[int, dict[str, list[str]]] = {}
    for cell in cells:
        overrides = cell_overrides(cell, folders)
        try:  # composed once: the refusal check, and the config the cell runs
            config = compose_cell(overrides, cell.strategy.world)
        except Exception as err:
            results[cell.id] = refusal(err)
            continue
        refs[key_of(reference_overrides(cell, folders))] = reference_overrides(cell, folders)
        refs |= floor_runs(cell, folders)
        if resumes(cell):
            save, world = save_plan(cell, folders)
            saves.setdefault(world, {})[key_of(save)] = save
        planned.setdefault(cell.strategy.world, {})[key_of([cell.id])] = (cell, config)
    _run_phases(planned, refs, saves, out, results, folders, start_method)
    return results


def _run_phases(planned, refs, saves, out: Path, results: dict, folders: dict[str, str], start_method: str) -> None:
    """World 1 (references, saves for other worlds, one-process cells), then each larger world
    (its saves, its cells), then the one-process cells that resume from a save at 2."""
    from framework.checkpoint.store import step_dir

    errors: dict[str, str] = {}

    def resumed(cell: Cell, config: dict) -> dict:  # validation checked the rest; the folder exists now
        root = out / key_of(save_plan(cell, folders)[0]) / "checkpoints"
        if not os.path.isdir(step_dir(str(root), SAVED_AT)):
            raise FileNotFoundError(f"the save at another world size left no {step_dir(str(root), SAVED_AT)}")
        return config | {"checkpoint": config["checkpoint"] | {"resume": step_dir(str(root), SAVED_AT)}}

    worlds = sorted(set(planned) | set(saves) | {1})
    phases = [(w, w == 1, False) for w in worlds] + [(1, False, True)]  # (world, references, late)
    for world, with_refs, late in phases:
        configs: dict[str, dict] = {}
        if with_refs:
            configs |= {k: compose_cell(o, 1) for k, o in refs.items()}
        if not late:
            configs |= {k: compose_cell(o, world) for k, o in saves.get(world, {}).items()}
        for key, (cell, config) in planned.get(world, {}).items():
            if resumes(cell) == late or (world > 1 and resumes(cell)):
                try:
                    configs[key] = resumed(cell, config) if resumes(cell) else config
                except Exception as err:  # a save that failed leaves no folder to resume
                    errors[key] = f"{type(err).__name__}: {err}"
        if configs:
            errors |= run_batch(configs, world, out, start_method)
    for world_cells in planned.values():
        for key, (cell, _) in world_cells.items():
            ref = out / key_of(reference_overrides(cell, folders))
            error = errors.get(key) or (f"the reference failed: {errors[ref.name]}" if ref.name in errors else None)
            try:
                floor = measured_floor(cell, out, folders, errors)
            except RuntimeError as err:
                error = error or str(err)
            results[cell.id] = ("FAILED", error, {}) if error else outcome(cell, out / key, ref, floor)
