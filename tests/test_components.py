"""Components (framework/components.py): a researcher's own optimizer and LR schedule, from a
package and a conf folder outside this repository (nothing in the framework edited), train under
ddp, fsdp, tp and pp x2 equal to one process; the framework's own choices are files of the same
form; Muon (framework/optimizers/muon.py) equals one process under every layout, resumes
bitwise and reshards; WSD logs its closed form. Each layout family runs as one multirun (one
launcher for its jobs)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from framework.config import ConfigError, compose, validate
from framework.optimizers.muon import newton_schulz
from tests.helpers import ROOT, losses, on_cpu, read_metrics, read_summary, train_cli

STEPS = 5
BASE = ["experiment=smoke", f"steps={STEPS}", "progress=false"]
NO_CLIP = "optim.grad_clip=0"  # (the framework's files list it; a user's file may leave it out: +optim.grad_clip)
ONE_BATCH = ["parallel=none,tp,pp", "data.batch_size=8"]  # one data-parallel rank: its batch is the global one
TWO_BATCHES = ["parallel=ddp,fsdp", "data.batch_size=4"]  # two: 2 x 4
TOLERANCE = 1e-4  # relative, per step (fp32: the layouts' reordered sums, ~1e-6)

USER_PACKAGE = '''
import os

import torch


class MyAdaGrad(torch.optim.Optimizer):
    """A researcher's optimizer: AdaGrad's step, elementwise (so it runs on DTensor shards)."""

    def __init__(self, params, lr=0.05, eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros_like(p)
                state["sum"].addcmul_(p.grad, p.grad)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(p.grad, state["sum"].sqrt().add_(group["eps"]), value=-group["lr"])


class FreezeEmb:
    """A researcher's converter: the embeddings' tables train no more; after each step it notes,
    in FREEZE_LOG, that they hold no gradient."""

    def __init__(self, log_every=1):
        self.log_every = log_every

    def convert(self, model):
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.requires_grad_(False)

    def post_optimizer_hook(self, model):
        tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
        frozen = all(not t.requires_grad and t.grad is None for t in tables)
        with open(os.environ["FREEZE_LOG"], "a") as log:
            log.write(("frozen" if frozen else "TRAINED") if tables else "no table here")
            log.write("\\n")


class InverseSqrt(torch.optim.lr_scheduler.LambdaLR):
    """A researcher's schedule: linear warm-up, then 1/sqrt(step)."""

    def __init__(self, optimizer, warmup=2):
        super().__init__(optimizer, lambda s: (s + 1) / warmup if s < warmup else (warmup / (s + 1)) ** 0.5)
'''
OPTIM_YAML = "_target_: mine_pkg.MyAdaGrad\n_partial_: true\nlr: 3e-2\n"
SCHEDULE_YAML = "_target_: mine_pkg.InverseSqrt\n_partial_: true\nwarmup: 2\n"
CONVERTER_YAML = "freeze_emb:\n  _target_: mine_pkg.FreezeEmb\n"  # a converter: an entry by its name


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A package and a conf folder outside the repository, as a researcher keeps them."""
    folder = tmp_path_factory.mktemp("researcher")
    (folder / "mine_pkg").mkdir()
    (folder / "mine_pkg" / "__init__.py").write_text(USER_PACKAGE)
    for group, text in (("optim", OPTIM_YAML), ("schedule", SCHEDULE_YAML), ("converters", CONVERTER_YAML)):
        (folder / "conf" / group).mkdir(parents=True)
        (folder / "conf" / group / ("freeze_emb.yaml" if group == "converters" else "mine.yaml")).write_text(text)
    sys.path.insert(0, str(folder))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), old) if p)
    yield folder
    sys.path.remove(str(folder))
    os.environ.pop("PYTHONPATH") if old is None else os.environ.__setitem__("PYTHONPATH", old)


def sweep(args: list[str], folder, env: dict[str, str] | None = None) -> dict[str, list[float]]:
    """One multirun; {parallel choice: its losses}."""
    proc = train_cli(["-m", *BASE, *args, f"hydra.sweep.dir={folder}"], timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [d for d in folder.iterdir() if (d / "summary.json").exists()]
    return {read_summary(d)["choices"]["parallel"]: losses(d) for d in jobs}


def assert_same(got: dict[str, list[float]], reference: list[float]) -> None:
    assert reference[-1] < reference[0]  # it trains: the comparison is not between constants
    for name, run in got.items():
        assert len(run) == STEPS, name
        for step, (a, b) in enumerate(zip(run, reference, strict=True), start=1):
            assert abs(a - b) / abs(b) <= TOLERANCE, f"{name} step {step}: {a} vs one process {b}"


@pytest.fixture(scope="module")
def adamw(tmp_path_factory) -> list[float]:
    """One process on the framework's default optimizer (AdamW): the losses a user's class and Muon
    must differ from (one run for both tests)."""
    return losses(_single(tmp_path_factory.mktemp("adamw") / "adamw", [NO_CLIP, "parallel=none", "data.batch_size=8"]))


def test_a_researchers_optimizer_schedule_and_converter_train_under_every_strategy(user, tmp_path, adamw):
    from framework.config.overrides import first_problem

    mine = [f"hydra.searchpath=[file://{user}/conf]", "optim=mine", "schedule=mine", "converters=[freeze_emb]"]
    # the run setting the user's file leaves out: added with `+`. train.py's check of its overrides
    # (exit 2 with `error: LINE`: tests/test_cli.py), here in this process
    assert first_problem(on_cpu([*BASE, NO_CLIP, *mine, "logger=none"])) == (
        "optim.grad_clip: optim=mine leaves it out (default 1.0); add it with +optim.grad_clip=0"
    )
    mine = [f"+{NO_CLIP}", *mine]
    log = tmp_path / "freeze.log"  # each rank's post-optimizer hook, after each step
    one = sweep([*mine, *ONE_BATCH], tmp_path / "one", {"FREEZE_LOG": str(log)})
    two = sweep([*mine, *TWO_BATCHES], tmp_path / "two", {"FREEZE_LOG": str(log)})
    reference = one.pop("none")
    assert_same(one | two, reference)
    # the converter ran at the one point for every layout (1 + 2 + 2 + 2 + 2 ranks), its hook after every
    # step; a pipeline's last stage holds no embedding table
    lines = log.read_text().splitlines()
    assert len(lines) == STEPS * 9 and lines.count("frozen") == STEPS * 8 and "TRAINED" not in lines, lines
    run = next(d for d in (tmp_path / "one").iterdir() if (d / "summary.json").exists())
    lrs = [m["lr"] for m in read_metrics(run)]  # the user's schedule, as its closed form says
    assert lrs == pytest.approx([3e-2 * ((s + 1) / 2 if s < 2 else (2 / (s + 1)) ** 0.5) for s in range(STEPS)])
    # the planner cannot price a class that declares nothing: it plans its state as empty, and says so
    note = read_summary(run)["plan"]["not_predicted"]["optim_bytes"]
    assert note.startswith("optim: mine_pkg.MyAdaGrad declares no planner_price; its state is planned as empty")
    assert abs(adamw[-1] - reference[-1]) > 1e-3  # the user's class ran, not the default


def _single(run, args):
    proc = train_cli([*BASE, *args], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_muon_equals_one_process_under_every_layout_and_differs_from_adamw(tmp_path, adamw):
    one = sweep([NO_CLIP, "optim=muon", *ONE_BATCH], tmp_path / "one")
    two = sweep([NO_CLIP, "optim=muon", *TWO_BATCHES], tmp_path / "two")
    hybrid = _single(tmp_path / "hybrid", [NO_CLIP, "optim=muon", "parallel=hybrid", "parallel.dp_shard=2", "parallel.tp=2",
                                           "launch.nproc_per_node=4", "data.batch_size=4"])  # fmt: skip
    reference = one.pop("none")
    assert_same(one | two | {"hybrid(dp_shard 2 x tp 2)": losses(hybrid)}, reference)
    assert max(abs(a - b) / b for a, b in zip(adamw[1:], reference[1:], strict=True)) > 1e-3


def test_muon_resumes_bitwise_and_reshards_from_ddp_to_fsdp(tmp_path):
    args = ["optim=muon", "data.batch_size=4", "steps=6", "schedule=wsd", "schedule.warmup_steps=2"]
    full = _single(tmp_path / "full", [*args, "parallel=ddp", "checkpoint.every=3"])
    saved = full / "checkpoints" / "step-000003"
    resumed = tmp_path / "resumed"  # both resumes in one multirun (a launcher's start saved)
    sweep([*args, "parallel=ddp,fsdp", f"checkpoint.resume={saved}"], resumed)
    jobs = {read_summary(d)["choices"]["parallel"]: d for d in resumed.iterdir() if (d / "summary.json").exists()}
    same, other = jobs["ddp"], jobs["fsdp"]
    want = {m["step"]: m for m in read_metrics(full)}
    for m in read_metrics(same):  # the same layout: bitwise, its LR (WSD's) too
        assert (m["loss"], m["lr"]) == (want[m["step"]]["loss"], want[m["step"]]["lr"]), m["step"]
    for m in read_metrics(other):  # resharded: Muon's momentum and AdamW's moments onto FSDP's shards
        assert m["loss"] == pytest.approx(want[m["step"]]["loss"], rel=TOLERANCE) and m["lr"] == want[m["step"]]["lr"]
    assert [m["step"] for m in read_metrics(other)] == [4, 5, 6]


def test_wsd_logs_its_closed_form_warm_up_hold_and_decay(tmp_path):
    steps, warmup, decay = 10, 2, 0.4
    run = _single(tmp_path / "wsd", ["parallel=none", f"steps={steps}", "schedule=wsd",
                                     f"schedule.warmup_steps={warmup}", f"schedule.decay_ratio={decay}",
                                     "schedule.decay_shape=linear", "schedule.min_lr_ratio=0.1"])  # fmt: skip
    lrs = [m["lr"] for m in read_metrics(run)]
    start = steps - round(decay * steps)  # 6: the decay's first step

    def closed(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 1.0 if s < start else 0.1 + 0.9 * (1 - (s - start) / (steps - start))

    assert lrs == pytest.approx([1e-3 * closed(s) for s in range(steps)], rel=1e-12)
    assert lrs[1] == lrs[5] == 1e-3 and lrs[6] == 1e-3 and lrs[7] < lrs[6]  # warmed up, held, decaying


def test_newton_schulz_orthogonalises_wide_tall_and_batched_matrices():
    torch.manual_seed(0)
    for shape in ((16, 48), (48, 16), (3, 16, 24)):
        g = torch.randn(shape)
        o = newton_schulz(g, 5).reshape(-1, *shape[-2:]) if len(shape) == 3 else newton_schulz(g, 5)[None]
        for m in o:
            s = torch.linalg.svdvals(m)
            assert 0.6 < s.min() and s.max() < 1.25, (shape, s)  # the quintic's band around 1, not exact
    g = torch.randn(8, 4, 3, 3)  # a convolution's filters: rows x (the rest)
    assert newton_schulz(g, 5).shape == g.shape


@pytest.mark.parametrize(
    "overrides,key,words",
    [
        (["+optim.lerning_rate=5"], "optim.lerning_rate", "did you mean 'lr'?"),
        (["optim.lr=fast"], "optim.lr", "expects a float"),
        (["optim._target_=torch.optim.Adamm"], "optim._target_", "module 'torch.optim' has no 'Adamm'"),
        (["optim._target_=nowhere_pkg.Opt"], "optim._target_", "is its folder on PYTHONPATH?"),
        (["optim=muon", "parallel=fsdp", "parallel.version=1"], "parallel.version", "FSDP1 (version 1) flattens"),
        (["optim=muon", "optim.grad_clip=0", "optim.in_backward=true"], "optim.in_backward", "cannot step one"),
        (["schedule=wsd", "schedule.decay_shape=cubic"], "schedule.decay_shape", "allowed: linear, cosine, sqrt"),
        (["+schedule.decay=0.1"], "schedule.decay", "WarmupCosine takes no such argument"),
    ],
)
def test_a_component_s_bad_key_or_value_is_one_line_naming_it(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        validate(compose(["experiment=smoke", "device=cpu", *overrides]))
    assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_torch_class_is_a_choice_as_it_is():
    """`optim._target_=torch.optim.Adam` trains Adam: the class, its kwargs, the framework's groups."""
    from framework.optimizers.build import build_optimizer

    cfg = compose(["experiment=smoke", "device=cpu", "optim._target_=torch.optim.Adam"])
    validate(cfg)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, cfg.optim)
    assert type(optimizer) is torch.optim.Adam and [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.0]
    assert math.isclose(optimizer.defaults["lr"], cfg.optim.lr)


@pytest.mark.parametrize(
    "override,head",
    [
        ("+optim.lerning_rate=5", "optim.lerning_rate: torch.optim.AdamW takes no such argument; did you mean 'lr'? "
         "it takes: lr, "),
        ("+model.n_layerz=3", "model.n_layerz: models.gpt.GPT takes no argument 'n_layerz'; did you mean 'n_layer'? "
         "it takes: vocab_size, "),
        ("+callbacks.spike.actoin=warn", "callbacks.spike.actoin: SpikeGuard takes no argument 'actoin'; did you "
         "mean 'action'? it takes: window, "),
    ],
)  # fmt: skip
def test_an_added_key_a_component_lacks_is_its_class_s_to_refuse(override, head):
    """A component's node (`_target_`) takes what its class takes (`+model.dim=64` for a user's
    model): its check refuses any other key, one line with the nearest and the class's arguments."""
    with pytest.raises(ConfigError) as err:
        validate(compose(["experiment=smoke", "device=cpu", override]))
    assert str(err.value).startswith(head) and "\n" not in str(err.value), str(err.value)


def test_plus_on_a_key_the_file_has_names_the_form_that_sets_it(tmp_path):
    """`+key=value` adds a key the config lacks: on `optim._target_` (every optim file names its
    class) it is one line naming the form that trains Adam (the test above); on a run setting a
    user's file leaves out (`grad_clip`) it adds it."""
    from framework.config.overrides import first_problem

    assert first_problem(["+optim._target_=torch.optim.Adam"]) == (
        "optim._target_: already in the config; + adds a key it lacks: set it with optim._target_=torch.optim.Adam"
    )
    (tmp_path / "optim").mkdir()
    (tmp_path / "optim" / "mine.yaml").write_text("_target_: torch.optim.Adam\n_partial_: true\nlr: 1e-3\n")
    cfg = compose(["experiment=smoke", "device=cpu", f"hydra.searchpath=[file://{tmp_path}]", "optim=mine",
                   "+optim.grad_clip=0"])  # fmt: skip
    validate(cfg)
    assert cfg.optim.grad_clip == 0


def test_help_lists_the_groups_a_user_picks_from():
    """`--help`: each group of conf/ and its choices, the components among them; not the schema/ groups."""
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    groups = proc.stdout.split("== Configuration groups ==\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert proc.returncode == 0 and "schema/" not in proc.stdout, proc.stdout[:2000]
    picked = {"optim: adamw, muon, sgd", "schedule: constant, cosine, wsd", "converters: float8, freeze"}
    assert picked <= set(groups), groups
    assert [g.split(":")[0] for g in groups] == sorted(
        d.name for d in (ROOT / "conf").iterdir() if d.is_dir() and d.name != "hydra"
    )
