"""lm-evaluation-harness on this framework's models: the model registered as `hydradist`.

    python -m framework.harness --model hydradist --model_args checkpoint=outputs/RUN --tasks hellaswag
    python -m framework.harness --model hydradist --model_args checkpoint=RUN --tasks my_task --include_path tasks/
    python -m framework.harness --model hydradist --model_args model=llama,model.pretrained=DIR,data=text --tasks ...

takes lm_eval's own arguments (this module registers the model, reads lm_eval's command line with
lm_eval's parser, builds the model, then runs lm_eval with it); from Python,
`lm_eval.simple_evaluate(model=HydradistLM("outputs/RUN"), tasks=[...])`.

`--model_args` are what every door reads (framework/config/door.py): `checkpoint=RUN` (a
checkpoint folder or a run folder) with train.py's overrides on top, or the overrides alone
(`model=llama,model.pretrained=DIR`: the pretrained weights, as train.py loads them). The model is
read as `framework.generate` reads it (one process, the config's tokenizer) and is built before
lm_eval reads its tasks: a bad input is one line and exit 2. The device: `--device`, else the
config's (`device=auto`: the GPU if there is one, else the CPU; lm_eval's own default is CUDA).
`loglikelihood` scores each continuation's tokens after its context in one forward (the context
cut from the left to the model's length; an empty context starts at the end-of-document id);
`loglikelihood_rolling` scores a whole text in windows of the model's length, each token once;
`generate_until` decodes greedily (or samples, as the task asks) with the KV cache until a stop
string, the end of document or `max_gen_toks`.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from framework.config import ConfigError
from framework.config.door import as_override
from framework.contract import logits_of
from framework.doors.generate import Sampling, open_lm, sample
from framework.doors.generate import max_length as model_length

LM_EVAL_OWN = ("batch_size", "max_batch_size")  # lm_eval's, given to every model: here one request at a time


@register_model("hydradist")
class HydradistLM(LM):
    def __init__(self, checkpoint: str | None = None, device: str | None = None, max_length: int | None = None,
                 **overrides):  # fmt: skip
        super().__init__()
        given = [f"{key}={as_override(value)}" for key, value in overrides.items() if key not in LM_EVAL_OWN]
        self.model, self.tok, self._device = open_lm(checkpoint, given, device)
        self.max_length = int(max_length or model_length(self.model) or 2048)

    def __str__(self) -> str:  # lm_eval names the model by it in its closing line
        return "hydradist"

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
    """lm_eval's command line, with `--model hydradist` built here first (lm_eval would build it
    after indexing its tasks, and on its default device, CUDA, where there is none). The parser
    is lm_eval's own (lm_eval._cli.harness, as in 0.4.13); its `run` takes a built model for `--model`."""
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging

    sys.argv = ["lm_eval", *argv]
    setup_logging()
    parser = HarnessCLI()
    try:
        args = parser.parse_args()
    except ValueError as err:  # lm_eval reads a first --model_args value holding a brace as JSON
        print(f"error: --model_args: {err} Or give each override its own argument, a mixture's after another: "
              "--model_args model=llama data.sources=[{path:A},{path:B}]", file=sys.stderr)  # fmt: skip
        return 2
    if getattr(args, "model", None) == "hydradist":
        settings = dict(args.model_args or {})
        try:
            args.model = HydradistLM(device=settings.pop("device", None) or args.device, **settings)
        except (ConfigError, FileNotFoundError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    parser.execute(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
