"""The config's types: choices are Enums, each choice's schema holds only its own keys, a bad
choice, key or value on the command line is one line and exit 2, every YAML key says what it is."""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import fields, is_dataclass

import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from framework.config import ConfigError, choices, validate
from framework.config.keys import dotted_keys
from framework.config.overrides import first_problem
from framework.config.parallel_schema import CPConfig, DDPConfig, FSDPConfig, MeshConfig, PPConfig, TPConfig
from framework.config.schema import GROUP_SCHEMAS
from tests.helpers import CONF, ROOT, compose_config, train_cli

CONFIG_DIR = ROOT / "framework" / "config"
NOT_DDP = {"schedule", "n_microbatches", "stages_per_rank", "tp", "pp", "cp", "dp_shard", "dp_replicate", "version",
           "reshard_after_forward", "reduce_dtype", "sharding_strategy", "sync_every_microbatch",
           "sequence_parallel", "loss_parallel", "cp_impl"}  # fmt: skip


def test_cfg_job_under_ddp_shows_only_ddps_keys(tmp_path):
    proc = train_cli(["--cfg", "job", "parallel=ddp"], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    parallel = yaml.safe_load(proc.stdout)["parallel"]
    assert parallel["name"] == "ddp" and "comm_hook" in parallel and "bucket_cap_mb" in parallel
    assert not NOT_DDP & set(parallel), NOT_DDP & set(parallel)


def test_each_choice_composes_with_its_own_keys_only():
    own = {name: {f.name for f in fields(schema)} for name, schema in GROUP_SCHEMAS["parallel"].items()}
    for name in ("none", "dp", "auto", "ddp", "fsdp", "tp", "pp", "cp", "hybrid"):
        keys = set(compose_config([f"parallel={name}"]).parallel)
        assert keys == own.get(name, own["base"]), name
    assert {"schedule", "sequence_parallel"}.isdisjoint(compose_config(["parallel=fsdp"]).parallel)
    assert {"version", "schedule"}.isdisjoint(compose_config(["parallel=tp"]).parallel)
    assert "checkpoint_every" not in compose_config(["memory=none"]).memory
    assert compose_config(["memory=checkpoint"]).memory.checkpoint_every == 1
    assert "init_scale" not in compose_config(["precision=bf16"]).precision
    assert (
        "momentum" not in compose_config(["optim=adamw"]).optim and "betas" not in compose_config(["optim=sgd"]).optim
    )


def test_a_widened_axis_takes_its_knobs_defaults():
    """`parallel=fsdp parallel.tp=2 parallel.pp=2` (README) composes without tp's or pp's knobs;
    the code that reads them takes these schemas' defaults (checked by the next test)."""
    from framework.parallel.pipeline import stages_per_rank
    from framework.plan.model import layout_of

    cfg = compose_config(["parallel=fsdp", "parallel.tp=2", "parallel.pp=2", "launch.nproc_per_node=8"])
    validate(cfg)
    layout = layout_of(cfg.parallel, 8, 4, 4)
    assert (layout.tp, layout.pp, layout.schedule, layout.n_microbatches) == (2, 2, "1F1B", 4)
    assert layout.sequence_parallel and not layout.loss_parallel and stages_per_rank(cfg.parallel) == 1


def _schema_defaults() -> dict[str, object]:
    """Each parallel key's default as the choice that owns it has it (the degrees: the mesh's)."""
    mesh = {f.name: f.default for f in fields(MeshConfig) if f.name != "name"}
    out = dict(mesh)
    for schema in (DDPConfig, FSDPConfig, TPConfig, PPConfig, CPConfig):
        out |= {f.name: f.default for f in fields(schema) if f.name not in mesh and f.name != "name"}
    return out


def test_knob_defaults_in_the_code_are_the_schemas():
    """Every `.get("<parallel knob>", default)` in framework/ reads the default its choice's schema has."""
    defaults, found = _schema_defaults(), 0
    for path in (ROOT / "framework").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value in defaults and isinstance(node.args[1], ast.Constant)):  # fmt: skip
                found += 1
                key = node.args[0].value
                assert node.args[1].value == defaults[key], f"{path.relative_to(ROOT)}:{node.lineno} {key}"
    assert found >= 10


def test_choices_are_enums_that_compare_as_strings():
    cfg = compose_config(["parallel=pp"])
    assert isinstance(cfg.parallel.name, choices.ParallelName) and cfg.parallel.name == "pp"
    assert f"{cfg.parallel.schedule}" == "1F1B" and {"1F1B": 1}[cfg.parallel.schedule] == 1
    for enum in vars(choices).values():
        if isinstance(enum, type) and issubclass(enum, choices.Choice) and enum is not choices.Choice:
            assert all(m.name == m.value for m in enum), enum  # a YAML value names its member
    import framework.config.validate as validate

    assert not hasattr(validate, "ALLOWED")


def test_the_enums_match_what_the_parts_accept():
    from framework.measure.memory import HOST_ALLOCATORS
    from framework.parallel.context import CP_IMPLS
    from framework.parallel.pipeline import SCHEDULES
    from framework.plan.profile import MEASURES

    assert tuple(choices.Schedule) == SCHEDULES
    assert tuple(choices.PlanProfile) == MEASURES
    assert set(choices.HostAllocator) == set(HOST_ALLOCATORS)
    assert set(choices.CpImpl) == set(CP_IMPLS)
    assert {p.stem for p in (CONF / "parallel").glob("*.yaml")} == set(choices.ParallelName)
    assert {p.stem for p in (CONF / "memory").glob("*.yaml")} == set(choices.MemoryName)


@pytest.mark.parametrize(
    "override,line",
    [
        ("parallel.comm_hook=int8", "parallel.comm_hook: got 'int8'; allowed: none, fp16, bf16, powersgd"),
        ("nonfinite=ignore", "nonfinite: got 'ignore'; allowed: stop, skip"),
        ("memory.host_allocator=fast", "memory.host_allocator: got 'fast'; allowed: auto, lean, steady, glibc"),
        ("checkpoint.monitor=val_los", "checkpoint.monitor: got 'val_los'; did you mean 'val_loss'? allowed: val_loss"),
        ("steps=abc", "steps: got 'abc'; Value 'abc' of type 'str' could not be converted to Integer"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key(override, line):
    with pytest.raises(ConfigCompositionException):  # the schema refuses it when Hydra composes
        compose_config([override])
    assert first_problem([override]) == line


def test_a_bad_value_of_a_choices_own_key_names_it():
    with pytest.raises(ConfigCompositionException):
        compose_config(["parallel=cp", "parallel.cp_impl=flash"])
    assert (
        first_problem(["parallel=cp", "parallel.cp_impl=flash"])
        == "parallel.cp_impl: got 'flash'; allowed: ring, torch"
    )


@pytest.mark.parametrize(
    "args,line",
    [
        (["model.n_layr=3"], "model.n_layr: no such key; did you mean 'model.n_layer'?"),
        (["parallel.schedule=GPipe"], "parallel.schedule: no such key with parallel=ddp; pp, hybrid have it"),
        (["memory.cpu_offload=true"], "memory.cpu_offload: no such key; use memory=offload (FSDP CPU offload)"),
        (["-m", "precision=fp32,bf17"], "precision: got 'bf17'; did you mean 'bf16'? allowed: amp, bf16, fp32"),
        (["--cfg", "job", "parallel=ddp", "-m", "optim.lr=interval(0.1,0.2)"], None),
        (["experiment=smoke", "+model.extra=1", "hydra.run.dir=/tmp/x"], None),
    ],
)
def test_overrides_are_checked_as_hydra_composes_them(args, line):
    assert first_problem(args) == line


# `+group.key=value` on a key the group's schema lacks: Hydra adds it with OmegaConf's force_add,
# which struct mode lets through whatever the schema declares; it is refused in one line, the
# plain form's. (A component's keys, `+optim.lerning_rate` or `+model.n_layerz`, are its class's
# to judge: tests/test_components.py, test_an_added_key_a_component_lacks_is_its_class_s_to_refuse.)
ADDED = [
    ("+parallel.foo=1", "parallel.foo: no such key; parallel takes: name, sync_batchnorm, bucket_cap_mb, "
     "gradient_as_bucket_view, static_graph, find_unused_parameters, broadcast_buffers, comm_hook, powersgd_rank"),
    ("+memory.lerning=2", "memory.lerning: no such key; memory takes: name, empty_cache_every, host_allocator"),
    ("+checkpoint.evry=3", "checkpoint.evry: no such key; did you mean 'checkpoint.every'?"),
    ("+launch.nprocs=2", "launch.nprocs: no such key; did you mean 'launch.nproc_per_node'?"),
    ("+backend.nccl.algoo=Ring", "backend.nccl.algoo: no such key; did you mean 'backend.nccl.algo'?"),
    ("+peft.rank=4", "peft.rank: no such key with peft=none; lora has it"),
    ("+foo=1", "foo: no such key"),
]  # fmt: skip


@pytest.mark.parametrize("override,line", ADDED)
def test_an_added_key_the_schema_lacks_is_refused_as_the_plain_form_is(override, line):
    """train.py composes once and validates (its plain run); `-m` and the other doors ask first_problem."""
    with pytest.raises(ConfigError) as err:
        validate(compose_config([override]))
    assert str(err.value) == line
    assert first_problem([override]) == line


def test_the_plain_form_says_the_same_line():
    for override, line in ADDED[:3]:
        assert first_problem([override[1:]]) == line


def test_every_section_with_a_schema_refuses_a_key_it_lacks():
    """Each section a dataclass types (a group's choice, a nested one, the top level) refuses a key
    added as Hydra adds `+key=value`; a component's node (`_target_`) is its class's to check."""
    cfg = compose_config(["experiment=smoke"])
    nodes = {k: OmegaConf.select(cfg, k) if k else cfg for k in ("", *dotted_keys(cfg))}
    sections = [k for k, n in nodes.items() if is_dataclass(OmegaConf.get_type(n)) and "_target_" not in n]
    assert {"", "parallel", "data", "memory", "peft", "precision", "backend", "backend.nccl", "logger", "launch",
            "checkpoint", "metrics", "plan", "eval", "profiler", "sweep"} <= set(sections), sections  # fmt: skip
    for section in sections:
        added = copy.deepcopy(cfg)
        key = f"{section}.no_such_knob".lstrip(".")
        OmegaConf.update(added, key, 1, force_add=True)  # what Hydra does with +key=1
        with pytest.raises(ConfigError) as err:
            validate(added)
        assert err.value.key == key and str(err.value).startswith(f"{key}: no such key"), str(err.value)


def _one_line_exit_2(proc, *parts: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert all(p in lines[0] for p in parts), lines[0]
    return lines[0]


def test_a_misspelt_choice_is_one_line_and_exit_2(tmp_path):
    proc = train_cli(["logger=none", "parallel=fdsp"], tmp_path / "run")
    line = _one_line_exit_2(proc, "parallel: got 'fdsp'; did you mean 'fsdp'? allowed: ")
    assert set(line.split("allowed: ")[1].split(", ")) == set(choices.ParallelName)
    assert not (tmp_path / "run").exists()


def test_a_misspelt_choice_in_a_sweep_stops_the_sweep_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = train_cli(["-m", "logger=none", "parallel=ddp,fdsp", f"hydra.sweep.dir={sweep}"])
    _one_line_exit_2(proc, "parallel: got 'fdsp'; did you mean 'fsdp'?")
    assert not sweep.exists()


def test_an_unknown_key_is_one_line_and_exit_2(tmp_path):
    proc = train_cli(["logger=none", "lr=0.01"], tmp_path / "run")
    assert _one_line_exit_2(proc) == "error: lr: no such key; did you mean 'optim.lr'?"


def test_dead_and_double_keys_are_gone():
    for schemas in GROUP_SCHEMAS.values():
        for schema in schemas.values():
            assert "cpu_offload" not in {f.name for f in fields(schema)}, schema
    assert compose_config(["memory=offload", "parallel=fsdp"]).memory.name == "offload"
    # data.val_fraction stays: evaluation holds the fraction out (framework/data/split.py)
    assert "val_fraction" in (ROOT / "framework" / "data" / "__init__.py").read_text()


def _uncommented_keys(text: str) -> list[str]:
    lines, bad = text.splitlines(), []
    for i, line in enumerate(lines):
        if re.match(r"^\s*[\w./@-]+\s*:", line) and line.strip() != "defaults:" and "#" not in line:
            if not (i and lines[i - 1].strip().startswith("#")):
                bad.append(line)
    return bad


def test_every_yaml_key_has_a_comment():
    """A trailing comment, or a comment line just above it."""
    assert _uncommented_keys("a: 1  # why\n# why\nb: 2\n") == [] and _uncommented_keys("c: 3\n") == ["c: 3"]
    bad = {str(p.relative_to(CONF)): b for p in CONF.rglob("*.yaml") if (b := _uncommented_keys(p.read_text()))}
    assert not bad, bad


def test_config_keeps_its_shape_and_its_layer():
    """Modules of at most 350 lines, functions of at most 60 lines and 6 parameters, and no import
    (at module level or inside a function) of the layers above: launch, plan, trainer."""
    for path in CONFIG_DIR.glob("*.py"):
        source = path.read_text()
        assert source.count("\n") <= 350, path.name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno + 1 <= 60, f"{path.name}:{node.name}"
                assert len(node.args.args) + len(node.args.kwonlyargs) <= 6, f"{path.name}:{node.name}"
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not re.match(r"framework\.(launch|plan|trainer|compose|summary)\b", node.module), path.name


@pytest.mark.parametrize("key", ["parallel.comm_hook", "nonfinite", "memory.host_allocator", "checkpoint.verify"])
def test_validate_checks_the_choices_of_a_config_made_from_a_dict(key):
    """A worker's config and a saved run's (framework/doors/evaluate.py) come from plain dicts, without the schema."""
    from omegaconf import OmegaConf

    from framework.config import ConfigError

    cfg = OmegaConf.create(OmegaConf.to_container(compose_config(["experiment=smoke"]), resolve=True))
    validate(cfg)
    OmegaConf.update(cfg, key, "bogus")
    with pytest.raises(ConfigError, match=f"^{key}: got 'bogus'; allowed: "):
        validate(cfg)
