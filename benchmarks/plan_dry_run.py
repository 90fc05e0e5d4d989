"""The planner's dry run at cluster scale: Llama 3 70B at 1,024 ranks (tensor 8 x pipeline 8 x
dp_shard 16, sequence parallel, bf16, every block recomputed, 8 micro-batches of 1 x 8,192
tokens) and GPT-3 175B at Megatron-LM's 384-rank layout (tensor 8 x pipeline 12 x 4 replicas,
384 micro-batches of 1 x 2,048 tokens), laid out by the real code for one rank of each role on a
fake process group (framework/plan/dry_run.py), beside the planner's forecast of the same layout.
Time and peak memory are this process's and its forked roles' (getrusage).

    python benchmarks/plan_dry_run.py
"""

from __future__ import annotations

import resource
import time

from common import table, write_result

from framework.config import compose
from framework.plan.dry_run import STATE, compare

CASES = [
    ("Llama 3 70B", 1024, "tp8 x pp8 x dp_shard16", [
        "model=llama", "model.flavor=70b", "model.vocab_size=128256", "data.seq_len=8192", "data.batch_size=8",
        "parallel=hybrid", "parallel.tp=8", "parallel.pp=8", "parallel.dp_shard=16", "parallel.n_microbatches=8",
        "parallel.sequence_parallel=true", "precision=bf16", "memory=checkpoint"]),
    ("GPT-3 175B", 384, "tp8 x pp12 x dp_replicate4", [
        "model=gpt", "model.n_layer=96", "model.n_embd=12288", "model.n_head=96", "model.vocab_size=51200",
        "data.seq_len=2048", "data.batch_size=384", "parallel=hybrid", "parallel.tp=8", "parallel.pp=12",
        "parallel.dp_replicate=4", "parallel.dp_shard=1", "parallel.sequence_parallel=false",
        "parallel.n_microbatches=384", "precision=bf16", "memory=checkpoint"]),
]  # fmt: skip
GB = 1e9


def peak_rss_bytes() -> int:
    """The largest resident set of this process and of any child it waited for (KiB on Linux)."""
    own, children = (resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return 1024 * max(own, children)


def rows() -> list[list]:
    out = []
    for name, world, layout, args in CASES:
        start = time.perf_counter()
        ranks, predicted = compare(compose([*args, "device=cpu", "logger=none"]), world)
        seconds = time.perf_counter() - start
        most = {k: max(r.state[k] for r in ranks) for k in STATE}
        saved = max(r.activation_bytes for r in ranks)
        exact = all(most[k] == predicted[k] for k in STATE)
        out.append([name, world, layout, len(ranks), *(most[k] / GB for k in STATE), "yes" if exact else "NO",
                    saved / GB, predicted["activation_bytes"] / GB, f"{predicted['activation_bytes'] / saved - 1:+.2%}",
                    seconds, peak_rss_bytes() / GB])  # fmt: skip
    return out


def main() -> None:
    text = table(["model", "ranks", "layout", "roles run", "param GB", "grad GB", "optim GB", "= planner",
                  "activations GB", "planner's GB", "planner error", "wall s", "peak RSS GB"], rows())  # fmt: skip
    print(text)
    write_result(
        "plan_dry_run", "python benchmarks/plan_dry_run.py",
        "Per rank, the most over the roles run (the rank holding most), from the sharded tensors of the real "
        "code on torch's fake process group; the planner's forecast is a formula of the same layout "
        "(framework/plan/model.py, activations.py). Activations: one micro-batch's forward and backward under "
        "the saved-activation meter, times the schedule's micro-batches in flight.", text,
    )  # fmt: skip


if __name__ == "__main__":
    main()
