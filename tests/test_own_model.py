"""Bring your own model: a model file outside the repository, with its own names, trains by config
only under every strategy, with the single-process losses, a non-null MFU and the planner's
state and wire figures; bad declarations are refused before any worker starts."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
from omegaconf import OmegaConf

from framework.run.sweep import run_configs
from tests.helpers import losses, read_metrics, run_workers, train_cli, world_config
from tests.test_front_doors import refused

TINY = """
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


class Layer(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(dim), Attention(dim, n_heads)
        self.ffn_norm, self.feed_forward = nn.LayerNorm(dim), FeedForward(dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLM(nn.Module):
    tp_plan = {
        "tok_embeddings": "embedding",
        "layers.*.attention_norm": "sequence_parallel",
        "layers.*.attention": "gather_input",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "sequence_parallel",
        "layers.*.feed_forward": "gather_input",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "norm": "sequence_parallel",
        "output": "output",
    }

    def __init__(self, vocab_size=256, dim=32, n_layers=4, n_heads=2):
        super().__init__()
        self.n_heads = n_heads
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(Layer(dim, n_heads) for _ in range(n_layers))
        self.norm, self.output = nn.LayerNorm(dim), nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))
"""

TINY_DATA = '''
import torch
from torch.utils.data import Dataset


class Windows(Dataset):
    """Random tokens in consecutive windows: (input, target) items, as a user writes them."""

    def __init__(self, samples=512, seq_len=32, vocab_size=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.seq_len, self.data = seq_len, torch.randint(0, vocab_size, (samples * seq_len + 1,), generator=g)

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]
'''

MODEL_YAML = """\
_target_: tiny.TinyLM
name: tiny
vocab_size: 256
dim: 32
n_layers: 4
n_heads: 2
"""

STEPS, GLOBAL_BATCH = 4, 8


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    """A folder outside the repository: tiny.py, and conf/model/tiny.yaml for hydra.searchpath."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "tiny.py").write_text(TINY)
    (folder / "tinydata.py").write_text(TINY_DATA)
    (folder / "conf" / "model").mkdir(parents=True)
    (folder / "conf" / "model" / "tiny.yaml").write_text(MODEL_YAML)
    sys.path.insert(0, str(folder))  # this process (and spawned workers, which inherit sys.path)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), old) if p)
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("tiny", None)  # this folder's tiny.py: not another test's (tests/test_readme.py)
    os.environ.pop("PYTHONPATH") if old is None else os.environ.__setitem__("PYTHONPATH", old)


def base(folder) -> list[str]:
    return ["experiment=smoke", "logger=none", f"steps={STEPS}", f"hydra.searchpath=[file://{folder}/conf]",
            "model=tiny", "optim.grad_clip=0"]  # fmt: skip


STRATEGIES = {
    2: {
        "ddp": ["parallel=ddp", "data.batch_size=4"],
        "fsdp": ["parallel=fsdp", "data.batch_size=4"],
        "tp": ["parallel=tp", "data.batch_size=8"],
        "tp_plain": ["parallel=tp", "parallel.sequence_parallel=false", "data.batch_size=8"],
        "pp": ["parallel=pp", "data.batch_size=8"],
    },
    4: {"hybrid": ["parallel=hybrid", "parallel.tp=2", "parallel.dp_shard=2", "data.batch_size=4"]},
}


@pytest.fixture(scope="module")
def runs(user_folder, tmp_path_factory):
    """One process on the global batch, then every strategy at 2 and 4 ranks (shared)."""
    from framework.run.trainer import run

    out = tmp_path_factory.mktemp("runs")
    cfg = OmegaConf.create(world_config([*base(user_folder), "parallel=none", f"data.batch_size={GLOBAL_BATCH}"], 1))
    results = {"none": run(cfg, str(out / "none"), {"parallel": "none"})}
    for world, strategies in STRATEGIES.items():
        configs = {name: world_config([*base(user_folder), *args], world) for name, args in strategies.items()}
        results |= run_configs(configs, world, str(out))
    return out, results


def test_own_model_matches_one_process_under_every_strategy(runs):
    out, summaries = runs
    reference = losses(out / "none")
    assert len(reference) == STEPS and reference[-1] < reference[0]
    for name, summary in summaries.items():
        assert summary["status"] == "ok" and summary["global_batch_size"] == GLOBAL_BATCH, name
        for step, (a, b) in enumerate(zip(losses(out / name), reference, strict=True), start=1):
            assert abs(a - b) / abs(b) <= 1e-4, f"{name} step {step}: {a} vs one process {b}"


def test_own_model_is_measured_and_planned(runs):
    out, summaries = runs
    for name, summary in summaries.items():
        assert summary["mfu"] is not None and summary["mfu"] > 0, name  # FLOPs counted on meta
        assert all(m["mfu"] is not None for m in read_metrics(out / name)), name
        if name == "none":
            continue
        error = summary["plan"]["error"]
        for figure in ("param_bytes", "grad_bytes", "optim_bytes", "wire_bytes", "comm_calls"):
            assert error[figure] == 0.0, (name, figure, error)  # exact, as for the built-ins
        assert summary["plan"]["predicted"]["activation_bytes"] is None  # not predicted: no gpt-like block declared


def _fsdp_units(rank, world, overrides):
    import torch
    from torch.distributed.fsdp import FSDPModule

    from framework.dist import DistInfo
    from framework.run.trainer import build

    cfg = OmegaConf.create(world_config(overrides, world))
    module = build(cfg, DistInfo(rank, world, rank, world, torch.device("cpu"), "gloo")).par.module
    return [name for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def test_fsdp_wraps_each_of_the_models_own_blocks(user_folder):
    units = run_workers(_fsdp_units, 2, [*base(user_folder), "parallel=fsdp"])[0]
    assert units == ["", "layers.0", "layers.1", "layers.2", "layers.3"]  # the root, then one unit per block


def test_target_on_the_command_line_trains(user_folder, tmp_path):
    args = ["experiment=smoke", "logger=none", "steps=2", "parallel=none", "model=custom",
            "model._target_=tiny.TinyLM", "+model.dim=16", "+model.n_layers=2"]  # fmt: skip
    proc = train_cli(args, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(losses(tmp_path / "run")) == 2


NO_PLAN = "class NoPlan(__import__('tiny').TinyLM):\n    tp_plan = {}\n"
BAD_PLAN = "class BadPlan(__import__('tiny').TinyLM):\n    tp_plan = {'layers.*.attention.nope': 'colwise'}\n"
FLAT = textwrap.dedent("""
    class Flat(__import__('torch').nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = __import__('torch').nn.Embedding(256, 8), __import__('torch').nn.Linear(8, 256)

        def forward(self, tokens):
            return self.out(self.emb(tokens))
    """)
NOT_A_CHAIN = textwrap.dedent("""
    class Skip(__import__('tiny').TinyLM):
        def forward(self, tokens):
            x = self.tok_embeddings(tokens)
            h = x
            for layer in self.layers:
                h = layer(h)
            return self.output(self.norm(h + x))
    """)


@pytest.mark.parametrize(
    "args,key,hint",
    [
        (["model._target_=nowhere.Model"], "model._target_", "cannot import 'nowhere.Model'"),
        (["model._target_=bad.NoPlan", "parallel=tp"], "parallel.tp", "declares none"),
        (["model._target_=bad.BadPlan", "parallel=tp"], "model.tp_plan", "names no submodule"),
        (["model._target_=bad.Skip", "parallel=pp"], "parallel", "embed(tokens)"),
        (["model._target_=bad.Flat", "parallel=pp"], "parallel.pp", "has none found"),
        (["model._target_=tiny.TinyLM", "+model.width=3"], "model.width", "takes no argument 'width'"),
        (["model=hf", "model.config=/no/such/folder"], "model.config", "config.json"),
    ],
)
def test_bad_model_declarations_are_one_line_before_any_worker(user_folder, tmp_path, args, key, hint):
    """Each is the launcher's check (validate, framework/doors/launch.py `admit`), which train.py
    prints as `error: LINE` and exits 2 before any worker. The first case runs train.py as a user
    does (a process: 5-9 s each); the others put their config to the same check in this process."""
    (user_folder / "bad.py").write_text("import tiny\n" + NO_PLAN + BAD_PLAN + NOT_A_CHAIN + FLAT)
    if not args[0].startswith("model=hf"):
        args = ["model=custom", *args]
    if key != "model._target_":
        line = f"error: {refused(['experiment=smoke', 'logger=none', *args])}"
        assert "\n" not in line and line.startswith(f"error: {key}:") and hint in line, line
        return
    proc = train_cli(["experiment=smoke", "logger=none", *args], tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"error: {key}:") and hint in lines[0], lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no worker started


def test_own_dataset_by_target_goes_through_the_distributed_sampler(user_folder, tmp_path):
    """data._target_: the user's Dataset, split over the data-parallel ranks by the framework's
    sampler: ddp x2 reads the global batch one process reads, so the losses match."""
    args = ["logger=none", "steps=3", "progress=false", f"hydra.searchpath=[file://{user_folder}/conf]", "model=tiny",
            "data=custom", "data._target_=tinydata.Windows", "data.seq_len=32"]  # fmt: skip
    reference = tmp_path / "none"
    assert train_cli([*args, "parallel=none", "data.batch_size=8"], reference).returncode == 0
    proc = train_cli([*args, "parallel=ddp", "launch.nproc_per_node=2", "data.batch_size=4"], tmp_path / "ddp")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for a, b in zip(losses(tmp_path / "ddp"), losses(reference), strict=True):
        assert abs(a - b) / abs(b) <= 1e-4
    assert read_metrics(reference)[0]["tokens_per_s"] is not None  # an lm's tokens are counted


def test_no_strategy_decision_names_a_model():
    """No code in framework/ decides by a model's name: what differs between models is declared."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "framework"
    pattern = re.compile(r"model\.name\s*(==|!=|in\b)|\"gpt\"|'gpt'")
    schemas = ("schema.py", "model_schema.py")  # a schema's defaults are names by definition
    code = [p for p in root.rglob("*.py") if p.name not in schemas]
    hits = [f"{p.relative_to(root)}:{i}" for p in code
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]  # fmt: skip
    assert hits == []


def _readme_blocks(language: str) -> list[str]:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "own_model.md").read_text()  # the README's, issue 66
    return [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith(language)]


def test_the_readmes_own_model_trains_as_the_readme_says(tmp_path):
    """The README's model file and YAML, written where a user would, under its commands' strategies."""
    (code,), (yaml,) = _readme_blocks("python"), _readme_blocks("yaml")
    (tmp_path / "tiny.py").write_text(code)
    (tmp_path / "my_conf" / "model").mkdir(parents=True)
    (tmp_path / "my_conf" / "model" / "tiny.yaml").write_text(yaml)
    env = {"PYTHONPATH": str(tmp_path)}
    smoke = ["experiment=smoke", "logger=none", "steps=2"]
    yaml_run = [f"hydra.searchpath=[file://{tmp_path}/my_conf]", "model=tiny", "parallel=fsdp"]
    cli_run = ["model=custom", "model._target_=tiny.TinyLM", "+model.dim=64", "parallel=pp"]
    for name, args in (("yaml", yaml_run), ("cli", cli_run)):
        proc = train_cli([*smoke, *args], tmp_path / name, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert len(losses(tmp_path / name)) == 2
