"""lm-evaluation-harness on this framework's checkpoints: the model registered as `hydradist`.

    python -m framework.harness --model hydradist --model_args checkpoint=outputs/RUN --tasks hellaswag
    python -m framework.harness --model hydradist --model_args checkpoint=RUN --tasks my_task --include_path tasks/

takes lm_eval's own arguments (this module registers the model, then runs lm_eval's command line);
from Python, `lm_eval.simple_evaluate(model=HydradistLM("outputs/RUN"), tasks=[...])`.

The checkpoint is read as `framework.generate` reads it (any layout, one process, the GPU if there
is one; the run's tokenizer). `loglikelihood` scores each continuation's tokens after its context
in one forward (the context cut from the left to the model's length; an empty context starts at
the end-of-document id); `loglikelihood_rolling` scores a whole text in windows of the model's
length, each token once; `generate_until` decodes greedily (or samples, as the task asks) with the
KV cache until a stop string, the end of document or `max_gen_toks`.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from framework.contract import logits_of
from framework.evaluate import resolve_checkpoint
from framework.generate import Sampling, load_lm, run_tokenizer, sample
from framework.generate import max_length as model_length


@register_model("hydradist")
class HydradistLM(LM):
    def __init__(self, checkpoint: str, device: str | None = None, max_length: int | None = None, **_ignored):
        from framework.checkpoint import store

        super().__init__()
        path = resolve_checkpoint(checkpoint)
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = load_lm(path, self._device)
        self.tok = run_tokenizer(store.find_config(path) or {})
        self.max_length = int(max_length or model_length(self.model) or 2048)

    def _logprobs(self, tokens: list[int]) -> torch.Tensor:
        """log p(tokens[i + 1] | tokens[: i + 1]) for each i, one forward (len(tokens) <= max_length + 1)."""
        x = torch.tensor([tokens], device=self._device)
        with torch.no_grad():
            logits = logits_of(self.model(x[:, :-1]))[0].float()
        return F.log_softmax(logits, -1), x[0, 1:]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for request in requests:
            context, continuation = request.args
            cont = self.tok.encode(continuation)
            whole = ((self.tok.encode(context) or [self.tok.eos_id]) + cont)[-(self.max_length + 1) :]
            n = min(len(cont), len(whole) - 1)  # the continuation's tokens, each predicted once
            logprobs, targets = self._logprobs(whole)
            logprobs, targets = logprobs[-n:], targets[-n:]
            score = logprobs.gather(-1, targets[:, None]).sum().item()
            out.append((score, bool((logprobs.argmax(-1) == targets).all())))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in requests:
            tokens = [self.tok.eos_id, *self.tok.encode(request.args[0])]
            total, start = 0.0, 1
            while start < len(tokens):  # each window predicts tokens[start:end] from up to max_length before
                end = min(start + self.max_length, len(tokens))
                window = tokens[max(0, end - self.max_length - 1) : end]
                logprobs, targets = self._logprobs(window)
                scored = end - start
                total += logprobs[-scored:].gather(-1, targets[-scored:, None]).sum().item()
                start = end
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for request in requests:
            context, kwargs = request.args
            until = [u for u in ([kwargs.get("until")] if isinstance(kwargs.get("until"), str)
                                 else kwargs.get("until") or []) if u]  # fmt: skip
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            prompt = (self.tok.encode(context) or [self.tok.eos_id])[-self.max_length :]
            new: list[int] = []
            tokens = torch.tensor([prompt], device=self._device)
            stream = sample(self.model, tokens, int(kwargs.get("max_gen_toks", 256)), Sampling(temperature))
            for nxt in stream:
                if int(nxt) == self.tok.eos_id:
                    break
                new.append(int(nxt))
                if until and any(u in self.tok.decode(new) for u in until):
                    break
            stream.close()
            text = self.tok.decode(new)
            for u in until:
                text = text.split(u, 1)[0]
            out.append(text)
        return out


def main(argv: list[str]) -> int:
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
