"""The matrix's runs: each cell composed and validated in this process (a refusal is its outcome),
the rest trained in groups of workers of each world size (a fresh group every GROUP_CONFIGS
configs), after the single-process references (tests/test_matrix.py). A config that raises ends its group: the configs before it are done, it is
recorded as FAILED, and a fresh group runs the ones after it, so one failure hides no other cell.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tests.helpers import on_cpu, read_metrics, write_tiny_llama_config
from tests.matrix import BASE, GLOBAL_BATCH, STEPS, TOLERANCE, Cell

SAVED_AT = 2  # a resumed cell's checkpoint: after this many steps, at another world size
# configs one group of workers trains before a fresh group takes the rest: each run's process
# groups keep their Gloo threads past destroy_process_group (held in C++ after FSDP and TP runs),
# and a worker with thousands of them trains each config slower than the last (1-2 s a cell at
# first, 12-90 s after 300)
GROUP_CONFIGS = 40


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


def key_of(overrides: list[str]) -> str:
    return hashlib.sha1("\n".join(overrides).encode()).hexdigest()[:12]


def resumes(cell: Cell) -> bool:
    return "resume" in cell.feature.overrides


def save_plan(cell: Cell, folders: dict[str, str]) -> tuple[list[str], int]:
    """A resumed cell's first part: SAVED_AT steps at another world size (one process for a
    strategy of several; ddp at 2 for one of one process), on the schedule of the whole run."""
    other = ["parallel=none"] if cell.strategy.world > 1 else ["parallel=ddp"]
    extra = [f"steps={SAVED_AT}", f"optim.schedule_steps={STEPS}", f"checkpoint.every={SAVED_AT}"]
    return _fill([*model_part(cell), *cell.feature.reference], folders) + other + extra, (
        1 if cell.strategy.world > 1 else 2
    )


def run_batch(configs: dict[str, dict], world: int, out: Path) -> dict[str, str]:
    """Train `configs` in groups of `world` workers; {name: error} of those that raised."""
    from framework.machine import launch_local
    from framework.run.sweep import device_and_backend

    errors: dict[str, str] = {}
    remaining = dict(configs)
    while remaining:
        group = dict(list(remaining.items())[:GROUP_CONFIGS])
        try:
            launch_local(world, _train_batch, group, str(out), device_and_backend(group))
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
            try:
                with Guard(info, cfg.checkpoint.preempt_grace_s) as guard:
                    train(cfg, info, RunFiles(str(run_dir), info), {"parallel": cfg.parallel.name}, guard)
            except BaseException as err:
                run_dir.mkdir(parents=True, exist_ok=True)
                trace = "".join(traceback.format_exception(err))
                (run_dir / f"error-rank{info.rank}.txt").write_text(trace)
                raise
            if info.is_main:
                (run_dir / "done").write_text(f"{time.perf_counter() - started:.2f}")
    finally:
        destroy_distributed()


def outcome(cell: Cell, run_dir: Path, ref_dir: Path, error: str | None) -> tuple[str, str]:
    """("parity", the worst relative difference) or ("FAILED", why) of a cell that ran."""
    if error is not None:
        return "FAILED", error
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("status") != "ok":
        return "FAILED", f"status {summary.get('status')}: {summary.get('error')}"
    got = {m["step"]: m["loss"] for m in read_metrics(run_dir)}
    want = {m["step"]: m["loss"] for m in read_metrics(ref_dir)}
    steps = range(SAVED_AT + 1, STEPS + 1) if resumes(cell) else range(1, STEPS + 1)
    if sorted(got) != list(steps):
        return "FAILED", f"logged steps {sorted(got)}, expected {list(steps)}"
    tol = TOLERANCE[cell.precision]
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)
    if worst > tol:
        return "FAILED", f"losses {[got[s] for s in steps]} vs one process {[want[s] for s in steps]}"
    if "checkpoint.export=true" in cell.feature.overrides and not any(
        (run_dir / f).exists() for f in ("model.pt", "hf")
    ):
        return "FAILED", "checkpoint.export=true wrote neither model.pt nor hf/"
    return "parity", f"worst relative difference {worst:.1e} (bound {tol:g})"


def refusal(err: Exception) -> tuple[str, str]:
    """A config error is a refusal if it is one line naming its key; anything else FAILED."""
    from framework.config import ConfigError

    text = str(err)
    if isinstance(err, ConfigError) and "\n" not in text and text.startswith(f"{err.key}: "):
        return "refused", text
    return "FAILED", f"{type(err).__name__} while composing: {text.strip().splitlines()[-1] if text.strip() else ''}"


def run_cells(cells: list[Cell], out: Path) -> dict[str, tuple[str, str]]:
    """{cell id: (outcome, detail)} for every cell: refusals composed here, then the references,
    the resumed cells' saves and the cells in groups of workers of each world size."""
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
        if resumes(cell):
            save, world = save_plan(cell, folders)
            saves.setdefault(world, {})[key_of(save)] = save
        planned.setdefault(cell.strategy.world, {})[key_of([cell.id])] = (cell, config)
    _run_phases(planned, refs, saves, out, results, folders)
    return results


def _run_phases(planned, refs, saves, out: Path, results: dict, folders: dict[str, str]) -> None:
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
            errors |= run_batch(configs, world, out)
    for world_cells in planned.values():
        for key, (cell, _) in world_cells.items():
            ref = out / key_of(reference_overrides(cell, folders))
            error = errors.get(key) or (f"the reference failed: {errors[ref.name]}" if ref.name in errors else None)
            results[cell.id] = outcome(cell, out / key, ref, error)
