"""Generation with a KV cache (models/kv_cache.py, framework/doors/generate.py): cached decoding equals
running the whole sequence for every token, for the gpt and the Llama (grouped-query attention,
llama3 rope scaling), equals transformers' own `generate` on the same weights, stops at the end of
a document, and samples from the nucleus. One process, tiny models."""

from __future__ import annotations

import os

import pytest
import torch

from framework.doors.generate import Sampling, generate, sample
from models.gpt import GPT
from models.kv_cache import caching
from models.llama import Llama

GREEDY = Sampling(temperature=0)


def models() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    gpt = GPT(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_embd=32).eval()
    llama = Llama("debug", dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=97, ffn_hidden=96,
                  rope_factor=8.0, rope_original_max_pos=16, max_seq_len=64).eval()  # fmt: skip
    return [gpt, llama]


@pytest.mark.parametrize("index", [0, 1], ids=["gpt", "llama"])
def test_cached_decoding_equals_running_the_whole_sequence_for_every_token(index):
    model = models()[index]
    prompt = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    cached = generate(model, prompt, 40, GREEDY)
    plain = generate(model, prompt, 40, GREEDY, cache=False)
    assert torch.equal(cached, plain)
    # and the logits themselves, step by step: a chunked prefill (3 tokens after 4) too
    tokens = cached[:, :20]
    with torch.no_grad():
        whole = model(tokens)
        with caching(model, 2, 20):
            parts = [model(tokens[:, :4]), model(tokens[:, 4:7]), *(model(tokens[:, i : i + 1]) for i in range(7, 20))]
    assert torch.allclose(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=0)
    assert all(m.cache is None for m in model.modules() if hasattr(m, "cache"))  # caches dropped after


def test_decoding_past_the_models_length_slides_its_window_without_the_cache():
    """A 64-token gpt asked for 80 tokens after 10: the cache serves up to its length, then the
    last 64 tokens run for each further one, as without a cache."""
    gpt = models()[0]
    prompt = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(2))
    assert torch.equal(generate(gpt, prompt, 80, GREEDY), generate(gpt, prompt, 80, GREEDY, cache=False))


def test_greedy_decoding_equals_transformers_generate_on_the_same_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tests.test_llama import hf_model, ours_from

    hf = hf_model(tmp_path, tie=False)
    ours = ours_from(tmp_path)
    prompt = torch.randint(0, 257, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert isinstance(hf, transformers.PreTrainedModel)
    assert torch.equal(generate(ours, prompt, 32, GREEDY), theirs)


def test_nucleus_sampling_keeps_the_fewest_tokens_that_reach_p():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (0.5 < 0.7 <= 0.8), and
    sampling draws only those, in proportion 5:3."""
    logits = torch.log(torch.tensor([[0.15, 0.5, 0.05, 0.3]]))
    how = Sampling(temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(0))
    drawn = torch.cat([how.pick(logits) for _ in range(4000)]).flatten()
    counts = torch.bincount(drawn, minlength=4)
    assert counts[0] == counts[2] == 0
    assert counts[1] / counts[3] == pytest.approx(5 / 3, rel=0.1)
    assert torch.equal(Sampling(temperature=1.0, top_k=1).pick(logits), torch.tensor([[1]]))


def test_the_stream_stops_where_asked_and_keeps_no_cache_behind():
    llama = models()[1]
    prompt = torch.zeros(1, 3, dtype=torch.long)
    stream = sample(llama, prompt, 10, GREEDY)
    first = [next(stream) for _ in range(3)]
    assert len(first) == 3 and llama.layers[0].attention.cache is not None
    stream.close()
    assert llama.layers[0].attention.cache is None
