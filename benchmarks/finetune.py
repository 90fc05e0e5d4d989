"""Decoding with the KV cache against running the whole context for every token: the debug Llama
(torchtitan's debug shape: 6 blocks of width 256, grouped-query attention) and the 4-block gpt,
greedy, 256 new tokens after a 16-token prompt, one process, side by side in one run (ratios, not
absolute times: the machine is shared). The two decodings give the same tokens (asserted here,
and by tests/test_generate.py).

    python benchmarks/finetune.py
"""

from __future__ import annotations

import time

import torch
from common import table, write_result

from framework.generate import Sampling, generate
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


def main() -> None:
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
    text = table(["model", "new tokens", "tokens/s, whole context each token", "tokens/s, KV cache",
                  "speed-up"], rows)  # fmt: skip
    print(text)
    write_result("finetune", "python benchmarks/finetune.py", HEADER, text)


HEADER = (
    "Greedy decoding of 256 new tokens after a 16-token prompt, one thread, the best of 3 runs each "
    "way in the same process: with the KV cache (`framework.generate`'s default: the prompt once, then "
    "each new token alone) and without it (`--no-cache`: the whole context runs for every token). "
    "Both decodings give the same tokens (asserted)."
)


if __name__ == "__main__":
    main()
