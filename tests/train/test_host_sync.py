"""A steady step never makes the host wait for the device (tessel.train.overlap, tessel.parallel.adamw).

On a GPU, torch.cuda.set_sync_debug_mode("error") turns every wait torch knows of (an `.item()`, a copy to
pageable memory, a stream synchronize) into an error during the steady steps. Without one (CI, this
machine), the trainer runs the GPU's order on the CPU: each step's numbers read once the next is queued
(Trainer.read_late) and the fused AdamW that skips a non-finite step on the device (torch's CPU kernel
standing in for CUDA's: tessel.parallel.adamw.FUSED_DEVICE_TYPES), and every call that would wait for a GPU
is counted (HostWaits), each with the tessel line that made it. A step may read the numbers the step
before it copied to the host (HostCopy.read: by then the device has a whole step queued); nothing else.
The same order must train as the CPU's own: the same skipped steps and rollbacks, the same losses.
"""

from __future__ import annotations

import os
import signal
import traceback

import pytest
import torch

from tessel.parallel import adamw
from tessel.spawn import spawn
from tessel.train.fault.preempt import Stopped
from tessel.train.overlap import HostCopy
from tests.helpers import build_trainer, tiny_config

# what waits for a GPU's queue to drain when called on a tensor on it: reading values on the host (a scalar, a
# list, a truth value, a format), copying them to it, and ops whose output size depends on the values. (A copy
# `.to(device)` cannot be told from one to the host when the device is the CPU: the GPU test checks copies.)
METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__format__", "numpy", "cpu",
           "nonzero", "masked_select", "unique", "bincount")
FUNCTIONS = ("nonzero", "masked_select", "unique", "unique_consecutive", "bincount")
QUIET = ["fault.heartbeat_s=0", "fault.straggler_every=0", "train.eval_every=0", "logging.progress=false",
         "train.sample_tokens=0"]


class HostWaits:
    """Records each call that would wait for a GPU while a step runs: (step being queued, call, the tessel line).

    The calls are patched on torch.Tensor and torch themselves, not caught by a TorchFunctionMode: a mode is not
    active inside autograd's hooks and callbacks, where data parallelism and ZeRO do their work."""

    def __init__(self):
        self.step: int | None = None
        self.waits: list[tuple[int, str, str]] = []
        self.reads: list[tuple[int, int]] = []  # (step that copied, step that read) of each HostCopy
        self.paused = 0

    def install(self, patch: pytest.MonkeyPatch) -> None:
        for owner, names in ((torch.Tensor, METHODS), (torch, FUNCTIONS)):
            for name in names:
                patch.setattr(owner, name, self._counted(name, getattr(owner, name)))

    def _counted(self, name, call):
        def counted(*args, **kwargs):
            if not self.paused and self.step is not None:
                self.waits.append((self.step, name, _tessel_line()))
            return self.paused_call(lambda: call(*args, **kwargs))  # its own inner calls are its wait
        return counted

    def watch(self, trainer, patch: pytest.MonkeyPatch) -> None:
        """Follow trainer's steps; its data (host memory by construction) and HostCopy reads are not waits."""
        launch, sampler, waits = trainer.launch_step, trainer.state.sampler, self
        patch.setattr(trainer, "launch_step", lambda step: (setattr(waits, "step", step), launch(step))[1])
        next_batch = sampler.next
        patch.setattr(sampler, "next", lambda: self.paused_call(next_batch))
        made, read = HostCopy.__init__, HostCopy.read

        def init(copy, values):
            copy.made_at = waits.step
            made(copy, values)

        def read_late(copy):
            waits.reads.append((copy.made_at, waits.step))
            return waits.paused_call(lambda: read(copy))
        patch.setattr(HostCopy, "__init__", init)
        patch.setattr(HostCopy, "read", read_late)
        self.install(patch)

    def paused_call(self, fn):
        self.paused += 1
        try:
            return fn()
        finally:
            self.paused -= 1


def _tessel_line() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/tessel/" in f.filename]
    return f"{frames[-1].filename.split('/tessel/')[-1]}:{frames[-1].lineno}" if frames else "?"


def _gpu_order(trainer) -> None:
    trainer.read_late = True


def _count_waits(overrides: tuple[str, ...], steps: int = 6, fused: bool = True) -> HostWaits:
    # the fused kernel, as on CUDA (a spawned rank sets its own module's)
    adamw.FUSED_DEVICE_TYPES = ("cpu",) if fused else ("cuda",)
    try:
        trainer, *_ = build_trainer(tiny_config(f"train.steps={steps}", *QUIET, *overrides))
        _gpu_order(trainer)
        counter = HostWaits()
        with pytest.MonkeyPatch.context() as patch:
            counter.watch(trainer, patch)
            trainer.fit()
    finally:
        adamw.FUSED_DEVICE_TYPES = ("cuda",)
    return counter


def _assert_steady(counter: HostWaits, steps: int, first_steady: int) -> None:
    steady = [w for w in counter.waits if w[0] >= first_steady]
    assert steady == [], f"the host waits for the device in steady steps: {steady}"
    # each step's numbers are read while the next one runs; the last's (nothing follows it) at once
    assert counter.reads == [(s, s + 1) for s in range(steps - 1)] + [(steps - 1, steps - 1)]


def test_a_steady_step_never_waits_for_the_device():
    counter = _count_waits(())
    _assert_steady(counter, 6, first_steady=0)
    # the counter sees waits where there are: AdamW's foreach path reads each step count on the host, and the
    # skip is decided there (free on the CPU, a wait per step on a GPU: why CUDA gets the fused kernel)
    foreach = _count_waits((), steps=2, fused=False)
    assert {line for _, name, line in foreach.waits if name == "item"} >= {"train/mesh_cohort.py:56",
                                                                             "train/mesh_cohort.py:57"}


def _ranks_count_waits() -> list[tuple[str, list, list]]:
    out = []
    for layout in (("parallel.dp=2",), ("parallel.dp=2", "parallel.zero_stage=3")):
        counter = _count_waits(layout)
        out.append((" ".join(layout), counter.waits, counter.reads))
    return out


def test_data_parallel_and_zero_steps_never_wait_for_the_device():
    for rank in spawn(_ranks_count_waits, 2):
        for layout, waits, reads in rank:
            counter = HostWaits()
            counter.waits, counter.reads = waits, reads
            # step 0 agrees once on the gradient norm's reductions (all_gather_object: parallel/norms.py)
            assert all(w[2].startswith("parallel/norms.py") for w in waits if w[0] == 0), (layout, waits)
            _assert_steady(counter, 6, first_steady=1)


def _nan_run(root: str, gpu_order: bool) -> list[tuple]:
    """8 steps, a NaN at step 2 and two at 5-6 (rollback to the step-4 checkpoint); gpu_order: read late, fused."""
    os.environ["TESSEL_FAULT"] = "nan:rank=0:step=2:count=1,nan:rank=0:step=5:count=2"
    if gpu_order:
        adamw.FUSED_DEVICE_TYPES = ("cpu",)
    try:
        cfg = tiny_config("train.steps=8", "fault.nan_tolerance=2", "checkpoint.every=4", *QUIET,
                          f'checkpoint.dir="{root}"', f'logging.out_dir="{root}/logs"')
        trainer, *_ = build_trainer(cfg)
        if gpu_order:
            _gpu_order(trainer)
        trainer.fit()
    finally:
        del os.environ["TESSEL_FAULT"]
        adamw.FUSED_DEVICE_TYPES = ("cuda",)
    return [(r["loss"], r["skipped"], r.get("rolled_back_to")) for r in trainer.history]


def test_the_gpu_order_skips_and_rolls_back_as_the_cpu_order(tmp_path):
    cpu, gpu = _nan_run(str(tmp_path / "cpu"), False), _nan_run(str(tmp_path / "gpu"), True)
    assert [s for _, s, _ in gpu] == [s for _, s, _ in cpu] and [b for *_, b in gpu] == [b for *_, b in cpu]
    assert [i for i, (_, s, _) in enumerate(gpu) if s] == [2, 5, 6] and gpu[6][2] == 4 and len(gpu) == 11
    # fused and foreach AdamW differ by a few fp32 ulps per update (tests/parallel/test_adamw.py): over 8
    # steps at the tiny recipe's lr the losses move ~1e-6; a skip that did not skip (a NaN update) or a
    # step applied twice moves them by 1e-2 or turns them to NaN
    losses = [(a, b) for (a, s, _), (b, _, _) in zip(cpu, gpu) if not s]
    torch.testing.assert_close(torch.tensor([b for _, b in losses]), torch.tensor([a for a, _ in losses]),
                               rtol=1e-5, atol=1e-5)


def test_a_host_copy_keeps_the_values_it_was_given():
    values = torch.tensor([1.0, float("nan"), 3.0])
    copy = HostCopy(values)
    values.zero_()  # the next step reuses the buffer: the copy must not follow it
    assert copy.ready() and copy.read()[::2] == [1.0, 3.0]


def test_a_stop_signal_read_late_stops_one_step_later():
    def stopped_at(gpu_order: bool) -> int:
        trainer, *_ = build_trainer(tiny_config("train.steps=8", *QUIET))
        if gpu_order:
            _gpu_order(trainer)
        launch = trainer.launch_step
        trainer.launch_step = lambda step: (setattr(trainer.stop, "signum", signal.SIGTERM if step == 3 else
                                                    trainer.stop.signum), launch(step))[1]
        with pytest.raises(Stopped) as stop:
            trainer.fit()
        return stop.value.step
    # every rank reads the agreed signal with step 3's numbers: at once on the CPU, after step 4 is queued on a GPU
    assert (stopped_at(False), stopped_at(True)) == (4, 5)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: torch.cuda.set_sync_debug_mode sees the host's waits on one")
def test_steady_steps_on_a_gpu_never_wait_for_it():
    from tessel.apply import parallelize
    from tessel.mesh import make_mesh
    from tessel.models.build import build_model
    from tessel.train.trainer import Trainer
    steps = 8
    cfg = tiny_config(f"train.steps={steps}", *QUIET)
    dev = torch.device("cuda", 0)
    mesh = make_mesh(cfg.parallel.axis_sizes, device=dev)
    model = build_model(cfg.model).to(dev)
    trainer = Trainer(cfg, mesh, parallelize(model, mesh, cfg), 0)
    assert trainer.read_late and adamw.skips_on_device(trainer.optimizer)
    launch = trainer.launch_step

    def strict(step: int):
        # steps 2..6 (warm-up done; the last one is read at once): any wait for the device raises here
        torch.cuda.set_sync_debug_mode("error" if 2 <= step < steps - 1 else "default")
        return launch(step)
    trainer.launch_step = strict
    try:
        trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(trainer.history) == steps and all(torch.isfinite(torch.tensor(r["loss"])) for r in trainer.history)
