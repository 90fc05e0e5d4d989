"""Convergence over a long run, per strategy family: a small Llama in bf16 for 300 steps under
ddp, tp, pp, cp and hybrid (dp_shard x tp), each against fsdp at the same tokens per step (16
sequences of 64 bytes); ep trains the Llama's MoE flavour against its own fsdp run; the Llama with
optim=muon under fsdp and tp, beside AdamW's rows; the Llama with emulated float8 linears
(converters=[float8]: rowwise and tensorwise under fsdp, rowwise under tp) against the bf16 fsdp
Llama, within 2%. As torchtitan's docs/converging.md does
for its N-D layouts, at this framework's scale: the loss curves overlaid in a plot, each family's
final loss (the mean of the last 20 steps) beside its reference's, and each curve's largest gap
to the reference (20-step means, and single steps).

    python benchmarks/converging.py                  # docs/results/converging.md and converging.png
    python benchmarks/converging.py --write-golden   # also tests/golden/converging.json (the references)
    python benchmarks/converging.py --only "llama, float8 rowwise"  # those rows and their references,
                                                     # printed only (the doc holds every row)

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
    # float8 linears, emulated on a CPU (framework/converters/float8.py): float8's casts and scales,
    # the matmul and the rest of the model in bf16 autocast as the bf16 rows
    "llama, float8 rowwise": [*LLAMA, "converters=[float8]", "converters.float8.recipe=rowwise"],
    "llama, float8 tensorwise": [*LLAMA, "converters=[float8]", "converters.float8.recipe=tensorwise"],
}
# a model held to another model's fsdp run (float8 to bf16's), and how close its final loss must be
REFERENCE = {"llama, float8 rowwise": "llama", "llama, float8 tensorwise": "llama"}
TOLERANCE = {"llama, float8 rowwise": 0.02, "llama, float8 tensorwise": 0.02}  # else 1%
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
    # emulated float8 against the bf16 fsdp Llama: fsdp (tensorwise gathers its weights in float8)
    # and tp (DTensor's own styles under gloo, float8 numerics the same)
    ("fsdp", "llama, float8 rowwise", ["parallel=fsdp", *TWO, "data.batch_size=8"]),
    ("fsdp", "llama, float8 tensorwise", ["parallel=fsdp", *TWO, "data.batch_size=8"]),
    ("tp", "llama, float8 rowwise", ["parallel=tp", *TWO, "data.batch_size=16"]),
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


def reference(key: tuple[str, str]) -> tuple[str, str]:
    """The (family, model) a row is held to: fsdp on its own model, or on the model REFERENCE names."""
    return ("fsdp", REFERENCE.get(key[1], key[1]))


def chosen(only: list[str] | None) -> list[tuple[str, str, list[str]]]:
    """RUNS, or the rows `--only` names (a model, or `family model`) and their references, in RUNS' order."""
    if not only:
        return RUNS
    if unknown := [o for o in only if not any(o in (m, f"{f} {m}") for f, m, _ in RUNS)]:
        sys.exit(f"error: --only: no row is {', '.join(map(repr, unknown))}; models: {', '.join(MODELS)}")
    named = {(f, m) for f, m, _ in RUNS if m in only or f"{f} {m}" in only}
    keys = named | {reference(k) for k in named}
    return [run for run in RUNS if run[:2] in keys]


def verdict(key: tuple[str, str], final: float) -> str:
    if key == reference(key):
        return "reference"
    tolerance = TOLERANCE.get(key[1], 0.01)
    return f"within {tolerance:.0%}" if abs(final) <= tolerance else f"OVER {tolerance:.0%}"


def plot(curves: dict[tuple[str, str], list[float]], path: Path) -> None:
    """A panel per reference model; a row held to another model's reference (float8) on its panel, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [m for m in MODELS if m not in REFERENCE and ("fsdp", m) in curves]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for (family, m), losses in curves.items():
            if REFERENCE.get(m, m) == panel:
                label = family if m == panel else f"{family}, {m.removeprefix(panel + ', ')}"
                style = {"lw": 2 if (family, m) == ("fsdp", panel) else 1, "ls": "--" if m != panel else "-"}
                ax.plot(range(1, len(losses) + 1), means(losses), label=label, **style)
        extra = " (dashed: float8 linears, emulated)" if any(REFERENCE.get(m) == panel for _, m in curves) else ""
        ax.set(title=f"{panel}: {TAIL}-step mean loss, bf16{extra}", xlabel="step", yscale="log")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("loss (bytes, nats)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def against_golden(curves: dict[tuple[str, str], list[float]]) -> None:
    """Each reference run beside its stored golden curve: unchanged, or by how much it moved."""
    stored = json.loads(GOLDEN.read_text())["losses"] if GOLDEN.exists() else {}
    for model, want in stored.items():
        if (got := curves.get(("fsdp", model))) is not None:
            drift = max(abs(g - w) / w for g, w in zip(got, want, strict=True))
            print(f"golden {model}: " + ("unchanged" if drift == 0 else f"moved (largest relative drift {drift:.1e})"))


def rows_of(curves: dict[tuple[str, str], list[float]], runs: list) -> list[list]:
    layouts = {(f, m): lay for f, m, lay in runs}
    rows = []
    for key, losses in curves.items():
        ref = curves[reference(key)]
        final, curve, step = gaps(losses, ref)
        layout = " ".join(a for a in layouts[key] if "batch" not in a)
        rows.append([*key, f"`{layout}`", losses[0], means(losses)[-1], means(ref)[-1], f"{final:+.2%}",
                     f"{curve:.2%}", f"{step:.2%}", verdict(key, final)])  # fmt: skip
    return rows


def main(args: argparse.Namespace) -> None:
    runs, curves = chosen(args.only), {}
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus(Path(tmp) / "grammar.txt")
        for i, (family, model, layout) in enumerate(runs):
            curves[(family, model)] = train(Path(tmp) / f"run{i}", overrides(model, layout, data))
            print(f"{family} {model}: {means(curves[(family, model)])[-1]:.4f}", flush=True)
    against_golden(curves)
    results = Path(os.environ.get("HYDRADIST_RESULTS_DIR", ROOT / "docs" / "results"))
    results.mkdir(parents=True, exist_ok=True)
    png = Path(tempfile.gettempdir()) / "converging_only.png" if args.only else results / "converging.png"
    plot(curves, png)
    print(f"\n{STEPS} steps, {TOKENS_PER_STEP} tokens a step (16 x {SEQ}), bf16, AdamW 3e-3 (20 warm-up steps, "
          f"cosine; Muon's rows: optim=muon at the same lr), seed 0, gloo on CPU; final: the mean of the last {TAIL} "
          f"steps; each row's reference is fsdp on its own model and optimizer, and the float8 rows' (converters="
          f"[float8], emulated: float8's casts and scales, the matmuls in bf16) the bf16 fsdp llama, within 2%\n")  # fmt: skip
    if ("fsdp", "llama") in curves and ("fsdp", "llama, muon") in curves:
        adamw, muon = means(curves[("fsdp", "llama")])[-1], means(curves[("fsdp", "llama, muon")])[-1]
        print(f"Muon against AdamW (fsdp, final loss): {muon:.4f} vs {adamw:.4f} ({(muon - adamw) / adamw:+.2%})\n")
    heads = ["family", "model", "layout", "step 1 loss", "final loss", "reference's final", "final gap",
             f"largest gap, {TAIL}-step means", "largest gap, one step", "final within 1% of its reference (float8: 2%)"]  # fmt: skip
    print(table(heads, rows_of(curves, runs)))
    print(f"\nplot: {png}" if args.only else "\n![loss curves](converging.png)")
    if args.write_golden:
        refs = {m: curves[("fsdp", m)] for m in MODELS if m not in REFERENCE}
        golden = {"command": "python benchmarks/converging.py --write-golden", "losses": refs}
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
        print(f"golden: {GOLDEN.relative_to(ROOT)}")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-golden", action="store_true", help=f"write the references to {GOLDEN}")
    parser.add_argument("--only", action="append", metavar="ROW",
                        help="a model (`llama, float8 rowwise`) or `family model` (`tp llama, float8 rowwise`): "
                        "its rows and their references, printed, nothing written; repeatable")  # fmt: skip
    args = parser.parse_args()
    if args.only and args.write_golden:
        parser.error("--write-golden writes every reference: run without --only")
    return args


if __name__ == "__main__":
    ARGS = parse()
    if ARGS.only:
        main(ARGS)
    else:
        with recorded("converging"):
            main(ARGS)
