"""Config composition and validation: every choice composes, bad input fails early and clearly."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.components import locate
from framework.config import ConfigError, validate
from framework.config.resolve import cuda_device_count
from tests.helpers import CONF, compose_config, write_tiny_llama_config

# a data choice each model trains on, and a model for each data choice
MODEL_DATA = {"gpt": "text", "mlp": "vectors", "resnet": "images", "lstm": "varlen", "hf": "text", "custom": "vectors",
              "llama": "text", "gpt_smoke": "text"}  # fmt: skip
DATA_MODEL = {"text": "gpt", "varlen": "gpt", "images": "resnet", "vectors": "mlp", "custom": "mlp", "tokens": "llama",
              "text_smoke": "gpt", "chat": "llama", "hf": "gpt"}  # fmt: skip
CUSTOM_DATA = ["data._target_=framework.data.datasets.SyntheticVectors", "+data.num_samples=256", "+data.dim=32",
               "+data.num_classes=8", "+data.seed=0"]  # fmt: skip
GROUPS = [
    "backend",
    "parallel",
    "precision",
    "memory",
    "peft",
    "data",
    "model",
    "optim",
    "schedule",
    "logger",
    "callbacks",
]
HEALTH_ORDER = ["spike", "straggler", "checksum"]  # callbacks/default.yaml's entries, a part file each in health/
HEALTH = set(HEALTH_ORDER)


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_every_group_has_choices_and_a_schema():
    for group in GROUPS:
        assert choices(group), group
    for name in ("auto", "gloo", "nccl", "mpi"):
        assert name in choices("backend")
    assert {"auto", "none", "dp", "ddp", "fsdp", "tp", "pp", "hybrid", "cp"} == set(choices("parallel"))
    assert {"fp32", "amp", "bf16"} == set(choices("precision"))
    assert {"gpt", "gpt_smoke", "llama", "mlp", "resnet", "lstm", "hf", "custom"} == set(choices("model"))
    assert {"default", "none"} == set(choices("callbacks"))  # the health entries' part files are no choices
    assert {p.stem for p in (CONF / "callbacks" / "health").glob("*.yaml")} == HEALTH


def _unavailable(group: str, name: str) -> str | None:
    """The key validate must name for choices this machine cannot run (None: it can run it). The
    suite composes with device=cpu (tests.helpers), on a GPU machine too: nccl, dp and CPU offload,
    which need CUDA tensors, are refused there (tests/test_gpu_ready.py composes this suite as on
    machines with GPUs, through the resolver's GPU count)."""
    if group == "backend" and name == "nccl":
        return "backend"
    if group == "backend" and name == "mpi" and not dist.is_mpi_available():
        return "backend"
    if group == "parallel" and name == "dp":  # DataParallel drives several GPUs: not on device=cpu
        return "parallel"
    if group == "memory" and name == "offload":
        return "memory"
    return None


@pytest.mark.parametrize("group,name", [(g, n) for g in GROUPS for n in choices(g)])
def test_every_group_choice_composes(group, name, tmp_path):
    overrides = [f"{group}={name}"]
    if group == "model":
        overrides.append(f"data={MODEL_DATA[name]}")
        if name == "custom":
            overrides.append("model._target_=models.mlp.MLP")
        if name == "hf":
            overrides.append(f"model.config={write_tiny_llama_config(tmp_path)}")
    if group == "data":
        overrides.append(f"model={DATA_MODEL[name]}")
        if name == "custom":
            overrides += CUSTOM_DATA
        if name == "tokens":  # token shards of a small text file
            from framework.data.prepare import main as prepare

            (tmp_path / "t.txt").write_text("some text to tokenize " * 40)
            assert prepare([str(tmp_path / "t.txt"), str(tmp_path / "shards"), "--no-progress", "--workers", "1"]) == 0
            overrides.append(f"data.path={tmp_path / 'shards'}")
        if name == "chat":  # a conversation and a tokenizer folder with its chat template
            from tests.test_finetune import CONVERSATION, chat_folder

            chat_folder(tmp_path / "tok")
            (tmp_path / "c.jsonl").write_text(__import__("json").dumps({"messages": CONVERSATION}) + "\n")
            overrides += [f"data.path={tmp_path / 'c.jsonl'}", f"data.tokenizer={tmp_path / 'tok'}"]
        if name == "hf":  # a JSON-lines file of text rows
            (tmp_path / "rows.jsonl").write_text('{"text": "a row of text"}\n' * 20)
            overrides.append(f"data.path={tmp_path / 'rows.jsonl'}")
    if group == "parallel" and name in ("none", "dp"):
        overrides.append("launch.nproc_per_node=1")
    if group == "memory" and name == "budget":  # the compiler's: refused without compile (test_memory_levers)
        overrides.append("compile=true")
    if group == "memory" and name == "offload":
        overrides.append("parallel=fsdp")
    if group == "parallel" and name == "auto":
        overrides += ["plan.latency_us=50", "plan.intra_node_gbps=1"]  # no link probe
    cfg = compose_config(overrides)
    if group == "callbacks":  # named entries, no `name`: a choice holds its files' entries
        assert set(cfg.callbacks) == {"default": HEALTH, "none": set()}[name]
    elif group in ("optim", "schedule"):  # components: a class by `_target_` (framework/components.py)
        assert isinstance(locate(cfg[group], group), type)
    else:
        assert cfg[group].name == {"gpt_smoke": "gpt", "text_smoke": "text"}.get(name, name)  # smoke's gpt is a gpt
    if group == "parallel" and name == "auto":  # the planner puts a real layout in its place before validation
        from framework.plan import plan_auto

        before = OmegaConf.to_container(cfg)
        choice = plan_auto(cfg, 2)
        assert OmegaConf.to_container(cfg) == before  # a pure function: the config is read, not written
        choice.apply(cfg)
        assert cfg.parallel.name in ("ddp", "fsdp", "tp", "pp") and choice.record["layout"]
        assert cfg.parallel.name == choice.record["overrides"][0].removeprefix("parallel=")
        assert "auto" not in cfg.plan  # the record travels beside the config, not in it
    key = _unavailable(group, name)
    if key is not None:
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert err.value.key == key and "; " in str(err.value)  # what is wrong; what to use instead
    else:
        validate(cfg)


@pytest.mark.parametrize("name", choices("experiment"))
def test_every_experiment_composes(name):
    cfg = compose_config([f"experiment={name}"])
    validate(cfg)
    from framework.config.model import model_spec

    assert cfg.data.name in (model_spec(cfg).trains_on or ("text", "varlen"))


def test_smoke_is_a_tiny_gpt_without_dropout():
    cfg = compose_config(["experiment=smoke"])
    assert cfg.model.name == "gpt" and cfg.model.dropout == 0.0 and cfg.steps <= 20


def test_defaults_are_the_documented_job():
    cfg = compose_config()
    assert (cfg.model.name, cfg.data.name, cfg.parallel.name, cfg.logger.name) == (
        "gpt",
        "text",
        "ddp",
        "wandb",
    )
    assert cfg.logger.mode == "offline"
    # the callbacks group's default: the health callbacks, each off until set (docs/health.md)
    assert list(cfg.callbacks) == HEALTH_ORDER and cfg.callbacks.spike.action == "off"
    for name in HEALTH_ORDER:  # each part file merged whole into the default choice (health/NAME@_here_)
        assert cfg.callbacks[name] == OmegaConf.load(CONF / "callbacks" / "health" / f"{name}.yaml")[name]
    assert cfg.callbacks.straggler.every == 0 and cfg.callbacks.checksum.every == 0
    mine = compose_config(["callbacks=none", "+callbacks.mine._target_=pkg.Mine", "+callbacks.mine.stop_at=3"])
    assert OmegaConf.to_container(mine.callbacks) == {"mine": {"_target_": "pkg.Mine", "stop_at": 3}}


def test_a_users_callbacks_file_is_a_choice_of_the_group(tmp_path):
    """conf/callbacks/mine.yaml of the user's (on Hydra's search path): `callbacks=mine` picks it;
    `defaults: [default]` at its top keeps the health entries beside the user's."""
    (tmp_path / "callbacks").mkdir()
    text = "defaults:\n  - default\n  - _self_\n# mine\nmine:\n  _target_: pkg.Mine\n  stop_at: 3\n"
    (tmp_path / "callbacks" / "mine.yaml").write_text(text)
    cfg = compose_config([f"hydra.searchpath=[file://{tmp_path}]", "callbacks=mine"])
    assert list(cfg.callbacks) == [*HEALTH_ORDER, "mine"] and cfg.callbacks.mine.stop_at == 3


@pytest.mark.parametrize(
    "args,line",
    [
        (["callbacks=bogus"], "callbacks: got 'bogus'; allowed: default, none"),  # the health parts are no choices
        (["callbacks=null"], "callbacks: got null; did you mean 'none'? allowed: default, none"),
        (["callbacks=none", "callbacks.spike.action=warn"], "callbacks.spike: callbacks=none has no 'spike' entry; "
         "pick callbacks=default, which holds it, or add one with +callbacks.spike._target_=pkg.Class (docs/callbacks.md)"),
        (["callbacks.mine.stop_at=3"], "callbacks.mine: callbacks=default has no 'mine' entry; "
         "add one with +callbacks.mine._target_=pkg.Class (docs/callbacks.md)"),
        (["callbacks.spike.actoin=warn"], "callbacks.spike.actoin: no such key; did you mean 'callbacks.spike.action'?"),
    ],
)  # fmt: skip
def test_a_callbacks_choice_or_entry_it_lacks_is_one_line(args, line, capsys):
    """train.py's check before Hydra: one line naming the key, what the choice holds and how to add
    an entry (Hydra's own: `callbacks.spike: no such key`, or a ValueError naming no group), exit 2."""
    from framework.config.overrides import check_overrides

    with pytest.raises(SystemExit) as stop:
        check_overrides(args)
    assert stop.value.code == 2 and capsys.readouterr().err == f"error: {line}\n"


@pytest.mark.parametrize(
    "override",
    [
        "steps=abc",
        "model.n_layr=3",
        "data.batch_size=1.5",
        "parallel.bucket_cap_mb=big",
        "launch.nproc_per_node=two",
        "parallel.comm_hook=int8",  # the choices are Enums (tests/test_config_schema.py: the one-line message)
        "nonfinite=ignore",
        "memory.host_allocator=fast",
        "parallel.schedule=GPipe",  # a pipeline knob under parallel=ddp
    ],
)
def test_typos_and_wrong_types_fail_at_compose_time(override):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)):
        compose_config([override])


@pytest.mark.parametrize(
    "overrides,key,hint",
    [
        (["steps=-1"], "steps", ">= 1"),
        (["accumulation_steps=0"], "accumulation_steps", ">= 1"),
        (["launch.nproc_per_node=0"], "launch.nproc_per_node", ">= 1"),
        (["parallel=none", "launch.nproc_per_node=2"], "launch.nproc_per_node", "parallel=none"),
        (["model=resnet"], "data", "data=images"),
        (["model.n_head=3"], "model.n_head", "n_head"),
        (["data.seq_len=256", "model.block_size=128"], "data.seq_len", "block_size"),
        (["data.path=/no/such/corpus"], "data.path", "/no/such/corpus"),
        (["data.prefetch_factor=4"], "data.prefetch_factor", "num_workers"),
        (["checkpoint.resume=/no/such/ckpt"], "checkpoint.resume", "/no/such/ckpt"),
        (["checkpoint.keep_last=-1"], "checkpoint.keep_last", ">= 0"),
        (["checkpoint.preempt_grace_s=0"], "checkpoint.preempt_grace_s", "> 0"),
        (["backend.step_timeout_s=0"], "backend.step_timeout_s", "null or > 0"),
        (["optim.lr=0"], "optim.lr", "> 0"),
        (["schedule.warmup_steps=-2"], "schedule.warmup_steps", ">= 0"),
        (["peft=lora", "peft.rank=0"], "peft.rank", ">= 1"),
        (
            ["parallel=tp", "model.n_head=3", "model.n_embd=48", "launch.nproc_per_node=2"],
            "parallel.tp",
            "heads",
        ),
        (["parallel=pp", "model.n_layer=1", "launch.nproc_per_node=2"], "parallel.pp", "layers"),
        (["parallel=pp", "parallel.n_microbatches=3"], "parallel.n_microbatches", "divide"),
        (
            ["parallel=fsdp", "parallel.tp=2", "launch.nproc_per_node=3"],
            "parallel.dp_shard",
            "does not divide",
        ),
        (
            [
                "parallel=hybrid",
                "parallel.tp=2",
                "parallel.pp=2",
                "parallel.dp_shard=2",
                "launch.nproc_per_node=4",
            ],
            "parallel",
            "world size is 4",
        ),
        (
            ["parallel=fsdp", "parallel.version=1", "parallel.sharding_strategy=HYBRID_SHARD"],
            "parallel.sharding_strategy",
            "dp_replicate",
        ),
        (["parallel=tp", "experiment=lstm"], "parallel.tp", "declares none"),
        (
            ["parallel=tp", "data.seq_len=31", "model.block_size=32"],
            "data.seq_len",
            "sequence parallel",
        ),
        (["parallel=dp", "launch.nproc_per_node=2"], "launch.nproc_per_node", "one process"),
        (["parallel=dp", "launch.nproc_per_node=1"], "parallel", "more than one CUDA"),
    ],
)
def test_validate_names_the_key_and_what_is_allowed(overrides, key, hint):
    with pytest.raises(ConfigError) as err:
        validate(compose_config(overrides))
    assert err.value.key == key
    assert hint in str(err.value)


# the line train.py prints after "error: " (one line, exit 2, before any worker starts)
HINTS = [
    (["model=custom", "model._target_=models.gpt.GPTT"],
     "model._target_: cannot import 'models.gpt.GPTT': module 'models.gpt' has no 'GPTT'"),
    (["model=custom", "model._target_=nowhere_pkg.Model"],
     "model._target_: cannot import 'nowhere_pkg.Model': no module 'nowhere_pkg'; is its folder on PYTHONPATH?"),
    (["model=hf", "model.pretrained=/no/such/dir"],  # model.config follows it: the key the user set is named
     "model.pretrained: no folder at '/no/such/dir'; give a folder with a Hugging Face config.json and its *.safetensors"),
    (["parallel=tp", "parallel.tp=3", "launch.nproc_per_node=2"],
     "parallel: dp_replicate(1) x dp_shard(1) x cp(1) x tp(3) x pp(1) = 3, but the world size is 2; "
     "set parallel.tp=-1 to fill it (tp=2)"),
    (["parallel=tp", "parallel.tp=2", "launch.nproc_per_node=4"],
     "parallel: dp_replicate(1) x dp_shard(1) x cp(1) x tp(2) x pp(1) = 2, but the world size is 4; "
     "set parallel.dp_shard=-1 to fill it (dp_shard=2)"),
    (["parallel=tp", "parallel.tp=3", "parallel.dp_shard=2", "launch.nproc_per_node=4"],
     "parallel: dp_replicate(1) x dp_shard(2) x cp(1) x tp(3) x pp(1) = 6, but the world size is 4; "
     "no degree set to -1 fills it: choose degrees whose product divides 4, or launch.nproc_per_node=6"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,line", HINTS)
def test_a_refusal_names_its_real_cause_and_advice_that_works(overrides, line):
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["experiment=smoke", *overrides]))
    assert str(err.value) == line
    if "to fill it" in line:  # the advice, taken, runs
        advised = line.split("set ", 1)[1].split(" ", 1)[0]
        validate(compose_config(["experiment=smoke", *overrides, advised]))


def test_a_model_without_a_plan_under_tp_is_one_reason(capsys):
    """No `sequence_parallel: off` note (the plan has no such entries) before the refusal that the
    model declares no plan at all: a note is said once the layout is accepted."""
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["parallel=tp", "experiment=lstm", "launch.nproc_per_node=2"]))
    assert str(err.value) == ("parallel.tp: tensor parallel needs the model's plan; LSTMClassifier declares none. "
                              "Declare tp_plan (submodule pattern -> colwise|rowwise|...) or set model.tp_plan")  # fmt: skip
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the message on a machine without CUDA")
def test_nccl_without_cuda_is_refused():
    with pytest.raises(ConfigError, match="nccl needs CUDA"):
        validate(compose_config(["backend=nccl"]))


def test_one_process_strategies_start_one_worker_by_default():
    from framework.config import resolve_nproc

    assert resolve_nproc(compose_config(["parallel=dp"])) == 1  # DataParallel drives every GPU from one process
    assert resolve_nproc(compose_config(["parallel=none"])) == 1
    assert resolve_nproc(compose_config(["parallel=dp", "launch.nproc_per_node=3"])) == 3


def test_a_saved_configs_group_choices_are_replaced_as_train_py_composes_them():
    """A door's overrides on a saved run's config (framework.config.overrides.apply_overrides): a
    group's choice replaces the whole group (peft, callbacks and the rest), a key sets one value."""
    from omegaconf import OmegaConf

    from framework.config.overrides import apply_overrides

    saved = OmegaConf.create(OmegaConf.to_container(compose_config(["peft=none"])))  # as read from the run's file
    cfg = apply_overrides(saved, ["peft=lora", "callbacks=none", "precision=bf16", "eval.steps=3"])
    assert cfg.peft.name == "lora" and cfg.peft.rank == compose_config(["peft=lora"]).peft.rank
    assert not cfg.callbacks and cfg.precision == compose_config(["precision=bf16"]).precision and cfg.eval.steps == 3
    for added, line in (
        ("+parallel.tp=2", "parallel.tp: no such key with parallel=ddp; fsdp, tp, pp, cp, hybrid have it"),
        ("+checkpoint.evry=3", "checkpoint.evry: no such key; did you mean 'checkpoint.every'?"),
    ):
        with pytest.raises(ConfigError) as err:  # a saved config is a plain dict: its choices' schemas say
            apply_overrides(OmegaConf.create(OmegaConf.to_container(compose_config())), [added])
        assert str(err.value) == line
