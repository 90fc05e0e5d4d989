"""What the framework costs: `train.py`'s gpt + DDP job against a plain hand-written DDP loop
(`raw_ddp.py`: same model class, data, batch, world size and threads), alternating A B, B A in one
invocation so that machine noise falls on both alike, in fp32 and bf16.

The framework runs as users run it: its default measurement (memory and communication sampled
on a few steps) and W&B logging (offline) on; its throughput here counts every step after the
first, the sampled ones included. Both sides: tokens over seconds of steps 2..N.

    python benchmarks/overhead.py                 # 3 pairs x fp32, bf16; 30 steps each run
    python benchmarks/overhead.py --pairs 5 --steps 50

With the optional extra `peers` installed (`pip install -e ".[peers]"`), the same job written with
Lightning Fabric and with Accelerate (`peers_ddp.py`) runs in every pair too, as extra columns.
The last line is `framework/raw throughput ratio: X`, the median of all pairs. Each pair also runs
the framework with a no-op user callback (`noop_callback.py`: every hook defined, one figure), so
the callback machinery's cost is its own column: `no-op callback / framework`.

    python benchmarks/overhead.py --hf-llama     # the tiny Llama row: model=hf under ddp against Accelerate

`--hf-llama` runs a tiny `LlamaForCausalLM` (a config this script writes; nothing downloaded)
under the framework's `model=hf parallel=ddp` against Accelerate's `prepare` loop on the same
model, in alternating pairs, and writes the table to docs/results/overhead_hf.md.
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

from common import recorded, table, write_result  # noqa: E402

MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq_len": 128, "batch_size": 8}  # train.py's default gpt job
WORLD = 2


def steady_rate(seconds: list[float], tokens: list[int]) -> float:
    """Tokens per second over every step but the first (warm-up)."""
    return sum(tokens[1:]) / sum(seconds[1:])


CALLBACK = ["+callbacks.noop._target_=noop_callback.EveryHook"]  # benchmarks/ is on the workers' path


def run_framework(steps: int, precision: str, out: Path, hf_config: str | None = None, extra: tuple = ()) -> float:
    model = ([f"model.n_layer={MODEL['n_layer']}", f"model.n_embd={MODEL['n_embd']}", f"model.n_head={MODEL['n_head']}"]
             if hf_config is None else ["model=hf", f"model.config={hf_config}"])  # fmt: skip
    # device=cpu: the raw loop it is compared with is a CPU/gloo loop, also on a machine with GPUs
    args = [sys.executable, str(ROOT / "train.py"), "device=cpu", f"steps={steps}", f"precision={precision}",
            "parallel=ddp", f"launch.nproc_per_node={WORLD}", f"hydra.run.dir={out}", *model,
            f"data.seq_len={MODEL['seq_len']}", f"data.batch_size={MODEL['batch_size']}", *extra]  # fmt: skip
    path = os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": path}
    subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return steady_rate(
        [r["step_time_s"] for r in records], [round(r["tokens_per_s"] * r["step_time_s"]) for r in records]
    )


def hook_cost(steps: int = 2000) -> tuple[float, float]:
    """The callback machinery's own time a step, in this process, without a user callback and with
    the no-op one (every hook called, its figure packed, read and logged): microseconds, the loop's
    calls as the trainer makes them, the step's work left out."""
    import time

    import torch
    from noop_callback import EveryHook

    from framework.hooks import Callbacks
    from framework.run.trainer import LOOP_FIGURES

    def per_step(named: list) -> float:
        hooks = Callbacks(named, WORLD)
        for figure in LOOP_FIGURES:
            hooks.figures.declare(figure, "loop", own=True)  # the loop's own (control/), as the trainer declares them
        own, device = {f.name: 0.0 for f in LOOP_FIGURES}, torch.device("cpu")
        t0 = time.perf_counter()
        for step in range(steps):
            for hook in ("on_step_start", "on_before_optimizer_step"):
                hooks.call(hook, step)
            hooks.call("on_before_backward", step, 0)
            packed = hooks.figures.pack(own | hooks.gather("on_step_end", step), 0, device)
            hooks.call("on_step_reduced", step, hooks.figures.totals(packed))
            figures = hooks.figures.read(packed.tolist())
            hooks.gather("on_settled", step, figures)
            hooks.call("on_log", step, figures)
        return (time.perf_counter() - t0) / steps * 1e6

    return per_step([]), per_step([("noop", EveryHook())])


def installed_peers() -> list[str]:
    import importlib.util

    return [name for name, module in (("fabric", "lightning"), ("accelerate", "accelerate"))
            if importlib.util.find_spec(module) is not None]  # fmt: skip


def run_raw(steps: int, precision: str, peer: str | None = None, hf_config: str | None = None) -> float:
    script = ["raw_ddp.py"] if peer is None else ["peers_ddp.py", f"--peer={peer}"]
    if hf_config is not None:
        script.append(f"--hf-config={hf_config}")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
            str(ROOT / "benchmarks" / script[0]), *script[1:], f"--steps={steps}", f"--precision={precision}",
            f"--n-layer={MODEL['n_layer']}", f"--n-embd={MODEL['n_embd']}", f"--n-head={MODEL['n_head']}",
            f"--seq-len={MODEL['seq_len']}", f"--batch-size={MODEL['batch_size']}"]  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:  # a standalone rendezvous can lose its port to another process: once more
        print(f"{script[0]} {' '.join(script[1:])} failed, retrying:\n{proc.stderr[-1500:]}", flush=True)
        proc = subprocess.run(args, cwd=ROOT, check=True, capture_output=True, text=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return steady_rate(result["seconds"], result["tokens"])


def hf_llama_row(pairs: int, steps: int) -> None:
    """The tiny Llama under model=hf + ddp against Accelerate's prepare loop, alternating pairs."""
    from transformers import LlamaConfig

    ratios, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "llama"
        LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=MODEL["seq_len"]).save_pretrained(config)  # fmt: skip
        for pair in range(pairs):
            out = Path(tmp) / f"run-{pair}"
            if pair % 2 == 0:
                ours = run_framework(steps, "fp32", out, str(config))
                peer = run_raw(steps, "fp32", "accelerate", str(config))
            else:
                peer = run_raw(steps, "fp32", "accelerate", str(config))
                ours = run_framework(steps, "fp32", out, str(config))
            ratios.append(ours / peer)
            rows.append([pair + 1, ours, peer, ours / peer])
            print(f"pair {pair + 1}: framework {ours:,.0f} tokens/s, accelerate {peer:,.0f}", flush=True)
    rows.append(["median", "", "", statistics.median(ratios)])
    text = table(
        ["pair", "framework model=hf ddp tokens/s", "accelerate prepare tokens/s", "framework / accelerate"], rows
    )
    header = (f"tiny LlamaForCausalLM 4x128 (GQA 4/2 heads), T={MODEL['seq_len']}, B={MODEL['batch_size']} per rank, "
              f"{WORLD} gloo ranks, DDP, fp32, {steps} steps per run (steady tokens/s, steps 2..N)")  # fmt: skip
    print(f"\n{header}\n\n{text}")
    write_result(
        "overhead_hf", f"python benchmarks/overhead.py --hf-llama --pairs {pairs} --steps {steps}", header, text
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--hf-llama", action="store_true", help="the tiny Llama row against Accelerate only")
    args = parser.parse_args()
    if args.hf_llama:
        hf_llama_row(args.pairs, args.steps)
        return

    peers = installed_peers()
    rows, ratios, hooks = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions.split(","):
            for pair in range(args.pairs):
                # A B in even pairs, B A in odd ones: whatever drifts within a pair falls on both
                out = Path(tmp) / f"{precision}-{pair}"
                hooked = Path(tmp) / f"{precision}-{pair}-noop"
                if pair % 2 == 0:
                    framework, raw = run_framework(args.steps, precision, out), run_raw(args.steps, precision)
                    noop = run_framework(args.steps, precision, hooked, extra=CALLBACK)
                else:
                    noop = run_framework(args.steps, precision, hooked, extra=CALLBACK)
                    raw, framework = run_raw(args.steps, precision), run_framework(args.steps, precision, out)
                others = [run_raw(args.steps, precision, peer) for peer in peers]
                ratios.setdefault(precision, []).append(framework / raw)
                hooks.setdefault(precision, []).append(noop / framework)
                rows.append([precision, pair + 1, framework, noop, raw, *others, framework / raw, noop / framework])
                print(f"{precision} pair {pair + 1}: framework {framework:,.0f} tokens/s, with a no-op callback "
                      f"{noop:,.0f}, raw {raw:,.0f}", flush=True)  # fmt: skip
    print(f"\ngpt {MODEL['n_layer']}x{MODEL['n_embd']}, T={MODEL['seq_len']}, B={MODEL['batch_size']} per rank, "
          f"{WORLD} gloo ranks, DDP, {args.steps} steps per run (steady tokens/s, steps 2..N)\n")  # fmt: skip
    peer_columns = [f"{peer} tokens/s" for peer in peers]
    print(table(["precision", "pair", "framework tokens/s", "framework + no-op callback tokens/s", "raw loop tokens/s",
                 *peer_columns, "framework / raw", "no-op callback / framework"], rows))  # fmt: skip
    print()
    medians = [[p, statistics.median(r), statistics.median(hooks[p])] for p, r in ratios.items()]
    print(table(["precision", "median framework / raw", "median no-op callback / framework"], medians))
    print(f"no-op callback/framework throughput ratio: {statistics.median(r for rs in hooks.values() for r in rs):.3f}")
    bare, noop = hook_cost()
    step_us = 1e6 * WORLD * MODEL["seq_len"] * MODEL["batch_size"] / statistics.median(r[2] for r in rows)
    print(
        f"callback machinery, in-process, a step: {bare:.0f} us without a user callback, {noop:.0f} us with the "
        f"no-op one (+{noop - bare:.0f} us, {(noop - bare) / step_us:.2%} of the median step above, {step_us:,.0f} us)"
    )
    print(f"framework/raw throughput ratio: {statistics.median(r for rs in ratios.values() for r in rs):.3f}")


if __name__ == "__main__":
    with recorded("overhead"):
        main()
