"""Our Llama against transformers' `LlamaForCausalLM` of the same shape, both trained by this
framework (`model=llama` against `model=hf`), under ddp x2 on gloo, alternating A B, B A pairs so
that machine noise falls on both alike. The table goes to docs/results/llama_vs_hf.md.

    python benchmarks/llama_vs_hf.py                # 3 pairs, 20 steps each run
    python benchmarks/llama_vs_hf.py --pairs 5 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from common import table, write_result  # noqa: E402
from overhead import steady_rate  # noqa: E402

JOB = ["parallel=ddp", "launch.nproc_per_node=2", "device=cpu", "data.seq_len=128", "data.batch_size=8",
       "logger=none", "progress=false"]  # fmt: skip


def run(model: list[str], steps: int, out: Path) -> float:
    args = [sys.executable, str(ROOT / "train.py"), *JOB, *model, f"steps={steps}", f"hydra.run.dir={out}"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return steady_rate([r["step_time_s"] for r in records],
                       [round(r["tokens_per_s"] * r["step_time_s"]) for r in records])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    from models.llama import llama_args
    from models.llama_hf import hf_config

    shape = llama_args("debug", vocab_size=256)  # what model=llama takes on byte text (${data_vocab:})
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "hf"
        config.mkdir()
        (config / "config.json").write_text(json.dumps(hf_config(shape)))
        ours_model = ["model=llama", "model.flavor=debug"]
        theirs_model = ["model=hf", f"model.config={config}"]
        for pair in range(args.pairs):
            order = [("ours", ours_model), ("hf", theirs_model)]
            rates = {name: run(model, args.steps, Path(tmp) / f"{name}-{pair}") for name, model in
                     (order if pair % 2 == 0 else order[::-1])}  # fmt: skip
            ratios.append(rates["ours"] / rates["hf"])
            rows.append([pair + 1, rates["ours"], rates["hf"], ratios[-1]])
            print(
                f"pair {pair + 1}: llama {rates['ours']:,.0f} tokens/s, LlamaForCausalLM {rates['hf']:,.0f}", flush=True
            )
    rows.append(["median", "", "", statistics.median(ratios)])
    header = (f"llama debug ({shape.n_layers} x {shape.dim}, {shape.n_heads}/{shape.n_kv_heads} heads), T=128, "
              f"B=8 per rank, ddp x2 on gloo, fp32, {args.steps} steps per run (steady tokens/s, steps 2..N)")  # fmt: skip
    text = table(["pair", "model=llama tokens/s", "model=hf (LlamaForCausalLM) tokens/s", "llama / hf"], rows)
    print(f"\n{header}\n\n{text}")
    write_result("llama_vs_hf", f"python benchmarks/llama_vs_hf.py --pairs {args.pairs} --steps {args.steps}",
                 header, text)  # fmt: skip


if __name__ == "__main__":
    main()
