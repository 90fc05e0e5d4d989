"""Fine-tuning's figures, each side by side in one run (ratios: the machine is shared):

- LoRA's model state per rank against full fine-tuning: the 150M Llama under fsdp x2, one step
  each way, the bytes each run's summary measures on its sharded tensors (parameters, gradients,
  AdamW's state);
- decoding with the KV cache against running the whole context for every token: the debug Llama
  (torchtitan's debug shape: 6 blocks of width 256, grouped-query attention) and the 4-block gpt,
  greedy, 256 new tokens after a 16-token prompt, one process. The two decodings give the same
  tokens (asserted here, and by tests/test_generate.py).

    python benchmarks/finetune.py
"""

from __future__ import annotations

import time

import torch
from common import run, table, write_result

from framework.doors.generate import Sampling, generate
from models.gpt import GPT
from models.llama import Llama

NEW, PROMPT, REPEATS = 256, 16, 3


def best_seconds(model, prompt: torch.Tensor, cache: bool) -> tuple[float, torch.Tensor]:
    """The fastest of REPEATS decodings (after one warm-up), and its tokens."""
    out = generate(model, prompt, 8, Sampling(temperature=0), cache)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        out = generate(model, prompt, NEW, Sampling(temperature=0), cache)
        times.append(time.perf_counter() - start)
    return min(times), out


# the 150m Llama (12 x 768, its 32,000-token vocabulary: 125M parameters), fsdp x2, one step of 2 sequences of
# 128 bytes per rank; LoRA on every linear of the blocks
LORA_COMMON = ["model=llama", "model.flavor=150m", "model.vocab_size=32000", "parallel=fsdp", "data.seq_len=128",
               "data.batch_size=2", "data.max_bytes=200000", "steps=1", "checkpoint.every=0"]  # fmt: skip
LORA_ROWS = {"full fine-tuning": [], "peft=lora (rank 8, every linear of the blocks)": ["peft=lora"]}
STATE = ("param_bytes", "grad_bytes", "optim_bytes")


def lora_rows() -> list[list]:
    summaries = run(LORA_ROWS, 2, LORA_COMMON)
    full = sum(summaries["full fine-tuning"]["memory"][k] for k in STATE)
    rows = []
    for name, summary in summaries.items():
        memory = summary["memory"]
        state = sum(memory[k] for k in STATE)
        rows.append([name, *(memory[k] / 2**20 for k in STATE), state / 2**20, f"{state / full:.2f}x"])
    return rows


def decoding_rows() -> list[list]:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core each way: the comparison is of work, not of threads
    models = {
        "llama debug (6 x 256, GQA 16/8)": Llama("debug").eval(),
        "gpt (4 x 128)": GPT(vocab_size=256, block_size=512).eval(),
    }
    rows = []
    for name, model in models.items():
        prompt = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))
        plain, plain_out = best_seconds(model, prompt, cache=False)
        cached, cached_out = best_seconds(model, prompt, cache=True)
        assert torch.equal(plain_out, cached_out), name
        rows.append([name, NEW, NEW / plain, NEW / cached, f"{plain / cached:.1f}x"])
    return rows


def main() -> None:
    lora = table(["run", "param MiB", "grad MiB", "optim MiB", "model state MiB per rank", "of full"], lora_rows())
    decoding = table(["model", "new tokens", "tokens/s, whole context each token", "tokens/s, KV cache",
                      "speed-up"], decoding_rows())  # fmt: skip
    text = (
        f"## LoRA's model state\n\n{LORA_HEADER}\n\n{lora}\n\n## Decoding with the KV cache\n\n{DECODING}\n\n{decoding}"
    )
    print(text)
    write_result("finetune", "python benchmarks/finetune.py", "", text)


LORA_HEADER = (
    "The 150m Llama (`model.flavor=150m`, 12 x 768, 32,000-token vocabulary: 125M parameters) under `parallel=fsdp` on 2 ranks, one step each way; the model state "
    "each rank holds, measured on its sharded tensors (`summary.memory`): with `peft=lora` the base stays "
    "(frozen, sharded) and only the adapters have gradients and AdamW's two moments."
)
DECODING = (
    "Greedy decoding of 256 new tokens after a 16-token prompt, one thread, the best of 3 runs each "
    "way in the same process: with the KV cache (`framework.generate`'s default: the prompt once, then "
    "each new token alone) and without it (`--no-cache`: the whole context runs for every token). "
    "Both decodings give the same tokens (asserted)."
)


if __name__ == "__main__":
    main()
