"""tessel on a CUDA device: a GPU rank trains as a CPU rank does, and `tessel train` runs, checkpoints and
resumes on it.

One process under NCCL: one GPU allows no more (NCCL refuses two ranks on one
device), so the multi-rank layouts' parity stays with the gloo tests; what
these check is every device-dependent path of one rank (the model, batches
and optimizer state on the GPU, NCCL collectives of the loss, gradient norm
and agreement, cuda RNG state in checkpoints, CUDA peak memory, determinism).
Skipped where torch sees no GPU (CI has none); run on a GPU machine with
`pytest tests/train/test_cuda.py`.
"""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from tests.helpers import cli_env, metrics_rows, tiny_config, train_command, write_recipe
from tessel.spawn import spawn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")

MODELS = {"dense": (), "moe": ("model.n_experts=4", "model.moe_top_k=2", "model.capacity_factor=1.25"),
          "hf-llama": ('model.hf_config="recipes/hf/llama_tiny/config.json"', "model.vocab_size=2048")}


def _train_on(device: str, overrides: tuple[str, ...]) -> dict:
    from tessel.apply import parallelize
    from tessel.mesh import make_mesh
    from tessel.models.build import build_model
    from tessel.train.trainer import Trainer
    cfg = tiny_config("train.steps=6", *overrides)
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    mesh = make_mesh(cfg.parallel.axis_sizes, device=dev)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model).to(dev)
    trainer = Trainer(cfg, mesh, parallelize(model, mesh, cfg), 0)
    summary = trainer.fit()
    return {"losses": summary.losses, "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "peak_mem_mb": trainer.history[-1]["peak_mem_mb"]}


@pytest.mark.parametrize("model", MODELS)
def test_a_gpu_rank_trains_as_a_cpu_rank(model):
    gpu = spawn(_train_on, 1, "cuda", MODELS[model], backend="nccl")[0]
    cpu = spawn(_train_on, 1, "cpu", MODELS[model])[0]
    print(f"{model}: largest |GPU - CPU| loss {max(abs(a - b) for a, b in zip(gpu['losses'], cpu['losses'])):.2e}, "
          f"weight {max((gpu['state'][k] - cpu['state'][k]).abs().max().item() for k in cpu['state']):.2e}")
    # fp32 on both (torch leaves TF32 off for matmuls by default): only the kernels' summation orders
    # differ, ~1e-7 relative per op; over 6 AdamW steps at lr 1e-2 the losses stay within 1e-4, where a
    # device bug (a batch or a state tensor left behind, a wrong dtype) moves them by 1e-2 or more.
    torch.testing.assert_close(gpu["losses"], cpu["losses"], rtol=0, atol=1e-4)
    # AdamW's first steps move every weight by about lr whatever the gradient's size, so a near-zero
    # gradient whose sign the two devices round differently can move a weight by up to 2 lr over a step;
    # 5e-3 (half a step) bounds the ordinary case and still fails a weight that missed updates.
    torch.testing.assert_close(gpu["state"], cpu["state"], rtol=0, atol=5e-3)
    assert 0 < gpu["peak_mem_mb"] < 1024  # CUDA's own count (max_memory_allocated), not the process's RSS


def test_compiled_blocks_and_the_fused_loss_train_on_a_gpu_as_eager_does():
    """Inductor's CUDA kernels (compiled blocks), the fused loss's CUDA path and the fused AdamW against the eager,
    unfused run on the same GPU, bf16 autocast as a GPU run trains; the CPU tests check the same with the
    CPU's kernels (tests/parallel/test_compile.py, tests/parallel/fused_loss)."""
    bf16 = ('train.precision="bf16"',)
    eager = spawn(_train_on, 1, "cuda", bf16, backend="nccl")[0]
    fast = spawn(_train_on, 1, "cuda", (*bf16, 'train.compile="blocks"', "train.fused_loss=true"), backend="nccl")[0]
    gap = max(abs(a - b) for a, b in zip(fast["losses"], eager["losses"]))
    print(f"largest |compiled+fused - eager| loss {gap:.2e}")
    # bf16 matmuls round to ~4e-3 relative, and inductor's fused kernels (and the fused loss's chunked fp32 sums)
    # round at other places than eager's: the same comparison on the CPU (inductor's CPU kernels) differs by
    # 1.2e-3 at most over these 6 steps of lr 1e-2; a lost gradient or a wrong head moves it by 1e-1 (the loss
    # starts at ln 256 = 5.5)
    torch.testing.assert_close(fast["losses"], eager["losses"], rtol=0, atol=2e-2)
    assert fast["losses"][-1] < fast["losses"][0]


def test_tessel_train_on_a_gpu_restarts_from_its_checkpoint_bit_exactly(tmp_path):
    recipe = write_recipe(tmp_path / "gpu.toml", 'runtime.device="cuda"', "train.deterministic=true",
                          "train.eval_every=5", "train.sample_tokens=8", "checkpoint.every=5", "train.steps=10")
    runs = {}
    for name, fault, args in (("whole", "", ()), ("killed", "kill:rank=0:step=7", ("--max-restarts", "1"))):
        out = runs[name] = tmp_path / name
        done = subprocess.run(train_command(recipe, out, "--resume", "auto", *args), env=cli_env(TESSEL_FAULT=fault),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "injecting kill on rank 0 at step 7" in log and "step_00000005" in log
    whole, killed = ({r["step"]: r for r in metrics_rows(runs[n])} for n in ("whole", "killed"))
    assert sorted(killed) == list(range(10))
    # deterministic kernels (tessel.runtime.make_deterministic) and the cuda RNG state in the checkpoint:
    # the steps replayed after the restart repeat the uninterrupted run's bit for bit
    assert [killed[s]["loss"] for s in range(10)] == [whole[s]["loss"] for s in range(10)]
    assert whole[9]["loss"] < whole[0]["loss"]
    assert all(0 < r["peak_mem_mb"] < 1024 for r in whole.values())  # CUDA's count, not the process's RSS


def test_bf16_on_a_gpu_follows_fp32():
    bf16 = spawn(_train_on, 1, "cuda", ('train.precision="bf16"',), backend="nccl")[0]
    fp32 = spawn(_train_on, 1, "cpu", ())[0]
    print("bf16 on the GPU:", bf16["losses"], "fp32 on the CPU:", fp32["losses"])
    # autocast rounds every matmul's inputs to bf16 (8 significant bits, 2**-9 relative): over two blocks
    # and the head the logits move by ~1%, a loss near 5.5 by a few 1e-2; 0.1 still fails a run that
    # does not learn (the loss falls by 0.2 over these 6 steps) or trains in the wrong dtype's range
    torch.testing.assert_close(bf16["losses"], fp32["losses"], rtol=0, atol=0.1)
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.1


def test_the_forward_timer_reads_cuda_events_and_counts_a_slow_host():
    from tessel.train.fault.stragglers import ForwardTimer
    device = torch.device("cuda", 0)
    layer = torch.nn.Linear(256, 256).to(device)
    timer = ForwardTimer([layer], device)
    layer.register_forward_pre_hook(lambda *_: time.sleep(0.05))  # after the timer's: a rank slowed on purpose
    x = torch.randn(64, 256, device=device)
    for _ in range(3):
        layer(x).sum().backward()
    with torch.no_grad():
        layer(x)  # evaluation is not a step's work
    # the events bracket each forward on the stream, the host's sleep between them included (a slowed
    # rank is still seen), and nothing was synchronized until take
    assert 0.15 <= timer.take() < 1.0
    assert timer.take() == 0.0
