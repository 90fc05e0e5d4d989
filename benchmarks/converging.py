"""Convergence over a long run, per strategy family: a small Llama in bf16 for 300 steps under
ddp, tp, pp, cp and hybrid (dp_shard x tp), each against fsdp at the same tokens per step (16
sequences of 64 bytes); ep trains the Llama's MoE flavour against its own fsdp run; the Llama with
optim=muon under fsdp and tp, beside AdamW's rows. As torchtitan's docs/converging.md does
for its N-D layouts, at this framework's scale: the loss curves overlaid in a plot, each family's
final loss (the mean of the last 20 steps) beside its reference's, and each curve's largest gap
to the reference (20-step means, and single steps).

    python benchmarks/converging.py                  # docs/results/converging.md and converging.png
    python benchmarks/converging.py --write-golden   # also tests/golden/converging.json (the references)

The data is a seeded grammar of English-like sentences (`corpus`): the same bytes on every
machine and Python, so the golden curves (tests/test_converging.py) hold anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import recorded, table  # noqa: E402

STEPS, TOKENS_PER_STEP, SEQ = 300, 16 * 64, 64
GOLDEN = ROOT / "tests" / "golden" / "converging.json"
LLAMA = ["model=llama", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_hidden=128"]  # fmt: skip
MODELS = {
    "llama": LLAMA,
    "llama(moe)": [*LLAMA, "model.moe.experts=4", "model.moe.top_k=2"],
    "llama, muon": [*LLAMA, "optim=muon"],  # Muon on the blocks' matrices (framework/optimizers/muon.py)
}
TWO = ["launch.nproc_per_node=2"]
# (family, model, layout): every family's layout holds 16 sequences a step (data.batch_size is per
# data-parallel rank); fsdp x2 on each model is the reference of that model's rows
RUNS = [
    ("fsdp", "llama", ["parallel=fsdp", *TWO, "data.batch_size=8"]),
    ("ddp", "llama", ["parallel=ddp", *TWO, "data.batch_size=8"]),
    ("tp", "llama", ["parallel=tp", *TWO, "data.batch_size=16"]),
    ("pp", "llama", ["parallel=pp", *TWO, "data.batch_size=16", "parallel.n_microbatches=4"]),
    ("cp", "llama", ["parallel=cp", *TWO, "data.batch_size=16"]),
    (
        "hybrid",
        "llama",
        ["parallel=hybrid", "parallel.dp_shard=2", "parallel.tp=2", "launch.nproc_per_node=4", "data.batch_size=8"],
    ),  # fmt: skip
    ("fsdp", "llama(moe)", ["parallel=fsdp", *TWO, "data.batch_size=8"]),
    ("ep", "llama(moe)", ["parallel=fsdp", "parallel.ep=2", *TWO, "data.batch_size=8"]),
    # Muon at AdamW's settings (its update's RMS matched to AdamW's): fsdp, and tp's sharded matrices
    ("fsdp", "llama, muon", ["parallel=fsdp", *TWO, "data.batch_size=8"]),
    ("tp", "llama, muon", ["parallel=tp", *TWO, "data.batch_size=16"]),
]
TAIL = 20  # steps averaged for a final loss and a curve's point (bf16 steps are noisy one by one)

WORDS = {
    "det": ["the", "a", "every", "some", "one"],
    "adj": ["quick", "lazy", "small", "bright", "old", "green", "quiet", "heavy"],
    "noun": ["fox", "dog", "river", "stone", "cloud", "garden", "engine", "letter", "window", "child"],
    "verb": ["jumps over", "looks at", "finds", "carries", "follows", "paints", "opens", "hears"],
    "adv": ["slowly", "today", "again", "at night", "with care", "in silence"],
}


def corpus(path: Path, n_bytes: int = 300_000, seed: int = 0) -> Path:
    """Sentences of a small grammar (`det adj noun verb det noun adv.`), seeded: a corpus a tiny
    model learns visibly within 300 steps, byte for byte the same everywhere."""
    rng, parts, size = random.Random(seed), [], 0
    while size < n_bytes:
        w = {k: rng.choice(v) for k, v in WORDS.items()}
        line = f"{w['det']} {w['adj']} {w['noun']} {w['verb']} the {rng.choice(WORDS['noun'])} {w['adv']}.\n"
        parts.append(line.capitalize())
        size += len(parts[-1])
    path.write_text("".join(parts))
    return path


def overrides(model: str, layout: list[str], data: Path, steps: int = STEPS) -> list[str]:
    """The run's train.py overrides: bf16, AdamW at 3e-3 with 20 warm-up steps, seed 0."""
    return [*MODELS[model], "data=text", f"data.path={data}", f"data.seq_len={SEQ}", "precision=bf16",
            "optim.lr=3e-3", "schedule.warmup_steps=20", f"steps={steps}", "seed=0", "logger=none", "progress=false",
            "device=cpu", "metrics.sample_every=0", "metrics.log_every=1", *layout]  # fmt: skip


def train(out: Path, args: list[str]) -> list[float]:
    """Every step's loss of `python train.py ARGS` run in `out`."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr[-2000:]}")
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def means(losses: list[float], n: int = TAIL) -> list[float]:
    """Each step's mean over the n steps ending there (fewer at the start)."""
    return [sum(losses[max(0, i + 1 - n) : i + 1]) / (i + 1 - max(0, i + 1 - n)) for i in range(len(losses))]


def gaps(got: list[float], want: list[float]) -> tuple[float, float, float]:
    """(final loss's relative gap, the 20-step curve's largest relative gap, a single step's)."""
    final = (means(got)[-1] - means(want)[-1]) / means(want)[-1]
    curve = max(abs(g - w) / w for g, w in zip(means(got), means(want), strict=True))
    step = max(abs(g - w) / w for g, w in zip(got, want, strict=True))
    return final, curve, step


def plot(curves: dict[tuple[str, str], list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(MODELS)
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), sharey=True)
    for ax, model in zip(axes, models, strict=True):
        for (family, m), losses in curves.items():
            if m == model:
                ax.plot(range(1, len(losses) + 1), means(losses), label=family, lw=2 if family == "fsdp" else 1)
        ax.set(title=f"{model}: {TAIL}-step mean loss, bf16", xlabel="step", yscale="log")
        ax.legend()
    axes[0].set_ylabel("loss (bytes, nats)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-golden", action="store_true", help=f"write the references to {GOLDEN}")
    args = parser.parse_args()
    curves: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus(Path(tmp) / "grammar.txt")
        for i, (family, model, layout) in enumerate(RUNS):
            curves[(family, model)] = train(Path(tmp) / f"run{i}", overrides(model, layout, data))
            print(f"{family} {model}: {means(curves[(family, model)])[-1]:.4f}", flush=True)
    rows = []
    for (family, model), losses in curves.items():
        ref = curves[("fsdp", model)]
        final, curve, step = gaps(losses, ref)
        layout = " ".join(a for a in dict(((f, m), lay) for f, m, lay in RUNS)[(family, model)] if "batch" not in a)
        verdict = "reference" if family == "fsdp" else ("within 1%" if abs(final) <= 0.01 else "OVER 1%")
        rows.append([family, model, f"`{layout}`", losses[0], means(losses)[-1], means(ref)[-1], f"{final:+.2%}",
                     f"{curve:.2%}", f"{step:.2%}", verdict])  # fmt: skip
    results = Path(os.environ.get("HYDRADIST_RESULTS_DIR", ROOT / "docs" / "results"))
    results.mkdir(parents=True, exist_ok=True)
    plot(curves, results / "converging.png")
    print(f"\n{STEPS} steps, {TOKENS_PER_STEP} tokens a step (16 x {SEQ}), bf16, AdamW 3e-3 (20 warm-up steps, "
          f"cosine; Muon's rows: optim=muon at the same lr), seed 0, gloo on CPU; final: the mean of the last {TAIL} "
          f"steps; each row's reference is fsdp on its own model and optimizer\n")  # fmt: skip
    adamw, muon = means(curves[("fsdp", "llama")])[-1], means(curves[("fsdp", "llama, muon")])[-1]
    print(f"Muon against AdamW (fsdp, final loss): {muon:.4f} vs {adamw:.4f} ({(muon - adamw) / adamw:+.2%})\n")
    heads = ["family", "model", "layout", "step 1 loss", "final loss", "fsdp's final", "final gap",
             f"largest gap, {TAIL}-step means", "largest gap, one step", "final within 1% of fsdp"]  # fmt: skip
    print(table(heads, rows))
    print("\n![loss curves](converging.png)")
    if args.write_golden:
        refs = {m: curves[("fsdp", m)] for m in MODELS}
        golden = {"command": "python benchmarks/converging.py --write-golden", "losses": refs}
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
        print(f"golden: {GOLDEN.relative_to(ROOT)}")


if __name__ == "__main__":
    with recorded("converging"):
        main()
