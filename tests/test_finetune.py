"""Fine-tuning's first step: a pretrained model's loss on the researcher's data before any
training here (`python -m framework.evaluate model=llama model.pretrained=DIR ...`, no checkpoint),
equal to transformers' loss on the same windows, as one process and under FSDP."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from tests.helpers import ROOT  # noqa: E402
from tests.test_llama import hf_model  # noqa: E402

SEQ = 32


def transformers_loss(hf, data: bytes) -> float:
    """The mean next-token loss over consecutive windows of SEQ + 1 bytes at 0, SEQ, 2 SEQ, ..."""
    windows = torch.tensor([list(data[i : i + SEQ + 1]) for i in range(0, len(data) - SEQ, SEQ)])
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    hf = hf_model(root / "hf", tie=False)
    text = root / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 7)  # 665 bytes: 20 windows of 32 and a dropped tail
    overrides = ["model=llama", f"model.pretrained={root / 'hf'}", "data=text", f"data.path={text}",
                 f"data.seq_len={SEQ}", "data.batch_size=4"]  # fmt: skip
    return hf, text, overrides


def test_a_pretrained_llama_is_evaluated_before_any_training_as_transformers_scores_it(pretrained):
    hf, text, overrides = pretrained
    proc = subprocess.run([sys.executable, "-m", "framework.evaluate", *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "as built (no checkpoint)" in proc.stdout and not (ROOT / "eval.json").exists()
    loss = float(re.search(r"^loss\s+([0-9.]+)$", proc.stdout, re.M).group(1))
    assert loss == pytest.approx(transformers_loss(hf, text.read_bytes()), abs=2e-6)  # printed to 6 places


def test_under_fsdp_the_pretrained_loss_is_the_same(pretrained):
    from framework.evaluate import run

    hf, text, overrides = pretrained
    got = run(None, [*overrides, "parallel=fsdp", "launch.nproc_per_node=2"])
    assert got["checkpoint"] is None and got["parallel"] == "fsdp" and got["terms"] == 20 * SEQ
    assert got["loss"] == pytest.approx(transformers_loss(hf, text.read_bytes()), rel=1e-5)


def test_without_a_checkpoint_a_misspelt_key_is_one_line(capsys):
    from framework.evaluate import main

    assert main(["model=llama", "model.pretraind=/nowhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.pretraind" in err[0], err
