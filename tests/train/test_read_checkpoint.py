"""A tessel checkpoint read in one process: by tessel's reader (any layout's checkpoint, whole tensors under
the model's names) and by docs/checkpoints.md's torch-only snippet, which must agree with it."""

from __future__ import annotations

import re

import torch

from tessel.train.checkpoint.read import read_model_tensors
from tests.helpers import ROOT, build_trainer, tiny_config


def page_snippet() -> str:
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    section = text[text.index("## Reading a tessel checkpoint with plain torch"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_page_snippet_and_tessel_read_the_trained_weights(tmp_path):
    cfg = tiny_config("model.tie_embeddings=true", "train.steps=2", "checkpoint.every=2", "fault.heartbeat_s=0",
                      f'checkpoint.dir="{tmp_path}"')
    trainer, model, _, _ = build_trainer(cfg)
    trainer.fit()
    path = tmp_path / "step_00000002"
    ours = read_model_tensors(path)
    assert ours.keys() == model.state_dict().keys()  # a tied weight under each of its names
    assert all(torch.equal(ours[k], v) for k, v in model.state_dict().items())
    namespace: dict = {}
    exec(page_snippet(), namespace)  # torch only: no tessel import in the snippet
    plain = namespace["read_checkpoint"](str(path))
    assert plain.keys() == ours.keys() and all(torch.equal(plain[k], ours[k]) for k in ours)
    assert "tessel" not in page_snippet().replace("tessel checkpoint", "").replace("tessel's", "")
