"""A ZeRO-3 run saves checkpoints while its parameters are sharded, and resumes bit for bit.

Between steps a stage-3 parameter's values cannot be read (UngatheredParameter): the
checkpoint takes the model's weights from ZeRO's own gathered masters
(ZeroAdamW.checkpoint_tensors), never from the module. Resuming at step 2 must replay
steps 2 and 3 exactly (the same arithmetic from the same state: no tolerance).
"""

from __future__ import annotations

from tessel.spawn import spawn
from tests.helpers import build_trainer, tiny_config


def _fit(root: str, name: str, *extra: str) -> list[float]:
    cfg = tiny_config("parallel.dp=2", "parallel.zero_stage=3", "train.steps=4", "checkpoint.every=2",
                      "fault.heartbeat_s=0", out_dir=f"{root}/{name}", *extra)
    return build_trainer(cfg)[0].fit().losses


def test_zero3_checkpoint_resumes_bit_for_bit(tmp_path):
    full = spawn(_fit, 2, str(tmp_path), "full")[0]
    resumed = spawn(_fit, 2, str(tmp_path), "resumed",
                    f'checkpoint.resume="{tmp_path}/full/checkpoints/step_00000002"')[0]
    assert resumed[-2:] == full[2:]
