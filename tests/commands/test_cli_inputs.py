"""Every bad input of a command is refused before any work or process: exit 2, one line on stderr
naming the argument, no traceback.

BAD is the table: one (argv, the text the error line must contain) row per case. `{tmp}` in an
argument is a folder holding the FILES below. Rows for more commands join the same table.
"""

import json
import multiprocessing.process
import subprocess
import sys

import numpy as np
import pytest

# imported now, not inside a test: a first matplotlib import may run fc-list, which no_spawn forbids
import tessel.calibrate.bench  # noqa: F401
import tessel.calibrate.topology_probe  # noqa: F401
import tessel.commands.cli
import tessel.observe.plots  # noqa: F401
import tessel.commands.planning  # noqa: F401
from tessel.comm.topology import Topology
from tests.helpers import write_recipe

ROW = {"loss": 5.5, "tokens_per_s": 1000.0, "lr": 1e-3}
HF_SHAPE = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 32}
FILES = {
    "good.jsonl": "".join(json.dumps({"step": s, **ROW}) + "\n" for s in range(3)),
    "not_json.jsonl": "step 0: loss 5.5\n",
    "no_loss.jsonl": json.dumps({"step": 0, "lr": 1e-3, "tokens_per_s": 1.0}) + "\n",
    "empty.jsonl": "",
    "a_file": "not a folder\n",
    # a recipe whose model is a Hugging Face config named by --set, and configs transformers would not build
    "hf.toml": "[train]\nsteps = 2\nglobal_batch = 8\nseq_len = 16\nwarmup_steps = 0\neval_every = 0\n"
               "sample_tokens = 0\n\n[data]\nsource = \"synthetic\"\n\n[parallel]\ndp = 2\n",
    **{f"{name}.json": json.dumps({**HF_SHAPE, **doc}) for name, doc in {
        "pad_outside": {"model_type": "qwen3", "pad_token_id": 151643},  # Qwen's pad id, the vocabulary cut down
        "layer_types": {"model_type": "qwen3", "layer_types": ["full_attention"]},  # 2 layers
        "typo": {"model_type": "llama9"},
        "doge_router": {"model_type": "doge", "num_experts": 16, "output_router_logits": True}}.items()},
}
UNWRITABLE = "/proc/tessel/out"  # /proc takes no new files, not even from root

BAD = [
    # plan
    (["plan", "--world", "0"], "--world"),
    (["plan", "--world", "abc"], "--world"),  # a usage error of the parser, one line too
    (["plan", "--global-batch", "0"], "--global-batch"),
    (["plan", "--top", "0"], "--top"),
    (["plan", "--cluster", "tpu"], "--cluster"),
    (["plan", "--model", "gpt-17"], "--model"),
    (["plan", "--precision", "fp4"], "--precision"),  # fp8 is a precision since issue 33
    (["plan", "--out", "{tmp}"], "--out"),  # a folder
    (["plan", "--out", UNWRITABLE + "/plan.toml"], "--out"),
    (["plan", "--out", "{tmp}/a_file/plan.toml"], "--out"),  # its parent is a file
    (["plan", "--cluster", "this", "--world", "1", "--layout", "dp=2"], "--layout"),  # before measuring
    (["plan", "--bogus"], "--bogus"),
    (["plan", "--tokens", "0"], "--tokens"),
    (["plan", "--tokens", "-3e9"], "--tokens"),
    (["plan", "--tokens", "many"], "--tokens"),
    (["plan", "--fix", "foo=1"], "--fix"),
    (["plan", "--fix", "tp"], "--fix"),
    (["plan", "--fix", "recompute=half"], "--fix"),
    (["plan", "--fix", ","], "--fix"),
    (["plan", "--model", "gpt3-1.3b", "--world", "16", "--fix", "tp=3"], "--fix"),  # no such layout
    (["plan", "--fix", "tp=2", "--layout", "dp=8"], "--fix"),
    (["plan", "--set", "cluster.bogus=1"], "cluster.bogus"),
    (["plan", "--set", "cluster.sharp=maybe"], "cluster.sharp"),
    (["plan", "--set", "cluster.inter.bandwidth=-1"], "cluster.inter.bandwidth"),
    (["plan", "--set", "cluster.gemm_efficiency=1.5"], "cluster.gemm_efficiency"),
    (["plan", "--set", "cluster.sharp"], "cluster.sharp"),
    (["plan", "--cluster", "this", "--world", "1", "--set", "cluster.sms=x"], "cluster.sms"),  # before measuring
    (["plan", "--network", "--layout", "dp=8"], "--network"),
    (["plan", "--network", "--cluster", "this"], "--network"),
    # simulate
    (["simulate", "--world", "-1"], "--world"),
    (["simulate", "--trace", UNWRITABLE + "/trace.json"], "--trace"),
    (["simulate", "--png", "{tmp}"], "--png"),
    (["simulate", "--tp-modes", "1"], "--tp-modes"),
    (["simulate", "--tp-modes", "8,x"], "--tp-modes"),
    (["simulate", "--tp-modes", "8", "--layout", "dp=8"], "--tp-modes"),
    (["plan", "--fix", "tp_mode=4d"], "--fix"),
    (["plan", "--model", "gpt3-1.3b", "--world", "16", "--layout", "dp=4,tp=4,mb=8,tp_mode=2.5d"], "parallel.tp_depth"),
    # probe
    (["probe", "--world", "0"], "--world"),
    (["probe", "--size-mb", "0"], "--size-mb"),
    (["probe", "--reps", "0"], "--reps"),
    (["probe", "--out", "{tmp}"], "--out"),
    # bench comm
    (["bench", "comm", "--sizes", "1X"], "--sizes"),
    (["bench", "comm", "--sizes", "4K,0"], "--sizes"),
    (["bench", "comm", "--world", "0"], "--world"),
    (["bench", "comm", "--iters", "0"], "--iters"),
    (["bench", "comm", "--iters", "x"], "--iters"),
    (["bench", "comm", "--warmup", "-1"], "--warmup"),
    (["bench", "comm", "--ops", "all_reduce,bcast"], "--ops"),
    (["bench", "comm", "--algorithms", "tree"], "--algorithms"),
    (["bench", "comm", "--ops", "all_gather", "--algorithms", "hierarchical"], "--algorithms"),  # no rows
    (["bench", "comm", "--world", "4", "--node-size", "3"], "--node-size"),
    (["bench", "comm", "--node-size", "0"], "--node-size"),
    (["bench", "comm", "--topology", "{tmp}/missing.json"], "--topology"),
    (["bench", "comm", "--topology", "{tmp}/not_json.jsonl"], "--topology"),
    (["bench", "comm", "--world", "4", "--topology", "{tmp}/topology2.json"], "--topology"),  # 2 ranks
    (["bench", "comm", "--json", "{tmp}"], "--json"),
    # plot
    (["plot"], "METRICS"),
    (["plot", "{tmp}/missing.jsonl"], "METRICS"),
    (["plot", "{tmp}/not_json.jsonl"], "METRICS"),
    (["plot", "{tmp}/no_loss.jsonl"], "'loss'"),
    (["plot", "{tmp}/empty.jsonl"], "METRICS"),
    (["plot", "{tmp}/good.jsonl", "--out", "{tmp}"], "--out"),
    (["plot", "{tmp}/good.jsonl", "--out", UNWRITABLE + "/curves.png"], "--out"),
    # train: the command line
    (["train", "{tmp}/tiny.toml", "--resume", "{tmp}/missing"], "--resume"),
    (["train", "{tmp}/tiny.toml", "--resume", "{tmp}/ckroot"], "--resume"),  # the checkpoints root
    (["train", "{tmp}/tiny.toml", "--resume", "{tmp}/ckroot/step_00000002"], "--resume"),  # no manifest
    (["train", "{tmp}/tiny.toml", "--resume", ""], "--resume"),
    (["train", "{tmp}/tiny.toml", "--nproc-per-node", "0"], "--nproc-per-node"),
    (["train", "{tmp}/tiny.toml", "--nproc-per-node", "3"], "--nproc-per-node"),  # the layout cannot take 3
    (["train", "{tmp}/tiny.toml", "--max-restarts", "-1"], "--max-restarts"),
    (["train", "{tmp}/tiny.toml", "--nnodes", "4:2"], "--nnodes"),
    (["train", "{tmp}/tiny.toml", "--nnodes", "3"], "--nnodes"),  # no rendezvous endpoint
    (["train", "{tmp}/tiny.toml", "--nnodes", "two"], "--nnodes"),
    (["train", "{tmp}/tiny.toml", "--grace", "0"], "--grace"),
    (["train", "{tmp}/tiny.toml", "--overwrite", "--resume", "auto"], "--overwrite"),
    # train: the recipe and the fields it sets
    (["train", "{tmp}/latin1.toml"], "recipe"),  # not UTF-8
    (["train", "{tmp}"], "recipe"),  # a folder
    (["train", "{tmp}/tiny.toml", "--set", "parallel.tp=3"], "parallel.tp"),
    # tp_mode: the grid's sizes and what it splits (tessel.config._check_tp_grid)
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="4d"'], "parallel.tp_mode"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="2d"', "--set", "parallel.tp=2"], "parallel.tp"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="3d"', "--set", "parallel.tp=9"], "parallel.tp"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="2.5d"', "--set", "parallel.tp=8",
      "--set", "parallel.tp_depth=3"], "parallel.tp"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="3d"', "--set", "parallel.tp=8",
      "--set", "model.d_model=36", "--set", "model.n_head=2"], "model.d_model"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.tp_depth=2"], "parallel.tp_depth"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="2.5d"', "--set", "parallel.tp=4"], "parallel.tp_depth"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="2d"', "--set", "parallel.tp=16",
      "--set", "model.d_model=40"], "model.d_model"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="2d"', "--set", "parallel.tp=4",
      "--set", "model.vocab_size=257"], "model.vocab_size"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="2d"', "--set", "parallel.tp=4",
      "--set", "train.global_batch=2"], "train.global_batch"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="2d"', "--set", "parallel.tp=4", "--set", "parallel.pp=2",
      "--set", "model.tie_embeddings=true"], "model.tie_embeddings"),  # tied under a grid: without a pipeline
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="2d"', "--set", "parallel.tp=4", "--set", "parallel.pp=2",
      "--set", "parallel.zero_stage=3"], "parallel.tp_mode"),  # ZeRO-3 x 2D x pp: not tested yet
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.tp_mode="2d"', "--set", "parallel.tp=4",
      "--set", "parallel.sequence_parallel=true"], "parallel.sequence_parallel"),  # nothing replicated to split
    (["train", "{assets}/llama.toml", "--set", 'logging.out_dir="{tmp}/out"', "--set", 'parallel.tp_mode="2d"',
      "--set", "parallel.tp=4", "--set", "parallel.pp=2", "--set", "parallel.dp=1"], "parallel.pp"),  # HF x grid x pp
    (["train", "{tmp}/tiny.toml", "--set", "train.seed=-1"], "train.seed"),
    (["train", "{tmp}/tiny.toml", "--set", "train.seed=18446744073709551616"], "train.seed"),
    (["train", "{tmp}/tiny.toml", "--set", 'train.sample_prompt=""', "--set", "train.sample_tokens=8"],
     "train.sample_prompt"),  # crashed after all of training
    (["train", "{tmp}/tiny.toml", "--set", 'runtime.device="cuda"'], "runtime.device"),  # no GPU here
    (["train", "{tmp}/tiny.toml", "--set", 'runtime.backend="nccl"'], "runtime.backend"),
    (["train", "{tmp}/tiny.toml", "--set", 'runtime.topology="{tmp}/not_json.jsonl"'], "runtime.topology"),
    (["train", "{tmp}/tiny.toml", "--set", "model.n_layer=100000"], "memory"),
    (["train", "{tmp}/tiny.toml", "--set", 'model.aux_loss_scope="batch"'], "model.aux_loss_scope"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.recompute="attention"'], "parallel.recompute"),
    # tessel's MoE routes to at most n_experts experts (a Hugging Face MoE to what its config declares)
    (["train", "{tmp}/tiny.toml", "--set", "model.n_experts=4", "--set", "model.moe_top_k=5"], "model.moe_top_k"),
    (["train", "{tmp}/tiny.toml", "--set", "model.n_experts=4", "--set", "model.moe_route_groups=3"],
     "model.moe_route_groups"),
    # fp8 (issue 33), overlapped tp and the plots switch: a wrong value, and what is not built
    (["train", "{tmp}/tiny.toml", "--set", 'train.fp8_recipe="blockwise"'], "train.fp8_recipe"),
    (["train", "{tmp}/tiny.toml", "--set", 'train.precision="fp8"', "--set", "parallel.tp=4", "--set",
      "parallel.dp=1", "--set", 'parallel.tp_mode="2d"'], "train.precision"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.tp_overlap=true"], "parallel.tp_overlap"),
    (["train", "{tmp}/tiny.toml", "--set", 'logging.plots="some"'], "logging.plots"),
    (["train", "{tmp}/tiny.toml", "--set", "train.global_batch=1000000000"], "memory"),
    # train: folders
    (["train", "{tmp}/tiny.toml", "--set", 'logging.out_dir="{tmp}/a_file"'], "logging.out_dir"),
    (["train", "{tmp}/tiny.toml", "--set", 'logging.out_dir="' + UNWRITABLE + '"'], "logging.out_dir"),
    (["train", "{tmp}/tiny.toml", "--set", "checkpoint.every=2", "--set", 'checkpoint.dir="{tmp}/a_file"'],
     "checkpoint.dir"),
    (["train", "{tmp}/tiny.toml", "--set", 'logging.out_dir="{tmp}/used"'], "logging.out_dir"),  # a run's files
    # train: data
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/empty.bin"'],
     "data.path"),
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/odd.bin"'],
     "data.path"),
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/short.bin"'],
     "train.seq_len"),
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/oov.bin"'],
     "data.path"),  # ids >= vocab_size: tp=1 crashed
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/oov.bin"',
      "--set", "parallel.tp=2", "--set", "parallel.dp=1"], "data.path"),  # tp=2 trained on them silently
    # train: weights and tokenizers
    (["train", "{tmp}/tiny.toml", "--set", 'model.init_from="{tmp}/missing.safetensors"'], "model.init_from"),
    (["train", "{tmp}/tiny.toml", "--set", 'model.init_from="{assets}/gpt-no-head.safetensors"'],
     "model.init_from"),  # a missing tensor, named before any rank starts
    (["train", "{tmp}/tiny.toml", "--set", 'model.init_from="{assets}/gpt"'], "model.init_from"),  # no safetensors
    (["train", "{assets}/llama.toml", "--set", 'logging.out_dir="{tmp}/out"', "--set",
      'model.init_from="{assets}/llama-no-norm.safetensors"'], "model.init_from"),  # one line, transformers' too
    (["train", "{assets}/mixtral.toml", "--set", 'logging.out_dir="{tmp}/out"', "--set", "parallel.pp=2", "--set",
      "parallel.virtual_stages=2", "--set", 'parallel.schedule="interleaved"', "--set", "parallel.micro_batches=2"],
     "parallel.virtual_stages"),  # Mixtral's router loss across stages: one chunk per pipeline rank
    # a Hugging Face config transformers would refuse on every rank: refused before spawn, in its words
    *[(["train", "{tmp}/hf.toml", "--set", 'logging.out_dir="{tmp}/out"', "--set", f'model.hf_config="{{tmp}}/{name}"'],
       key) for name, key in (("pad_outside.json", "pad_token_id"), ("layer_types.json", "layer_types"),
                              ("typo.json", "model_type"), ("doge_router.json", "output_router_logits"))],
    (["train", "{tmp}/tiny.toml", "--set", 'data.tokenizer="{tmp}/missing.json"'], "data.tokenizer"),
    (["train", "{tmp}/tiny.toml", "--set", 'data.tokenizer="{tmp}/not_json.jsonl"'], "data.tokenizer"),
    (["train", "{tmp}/tiny.toml", "--set", 'data.tokenizer="{assets}/bpe300.json"'], "data.tokenizer"),  # > vocab
    (["train", "{tmp}/tiny.toml", "--set", 'data.tokenizer="stdlib-bpe-70000"'], "data.tokenizer"),
    # export
    (["export", "--out", "{tmp}/o"], "CHECKPOINT"),
    (["export", "{assets}/gpt/step_00000001"], "--out"),
    (["export", "{tmp}/missing", "--out", "{tmp}/o"], "CHECKPOINT"),
    (["export", "{tmp}/a_file", "--out", "{tmp}/o"], "CHECKPOINT"),
    (["export", "{tmp}/ckroot", "--out", "{tmp}/o"], "CHECKPOINT"),  # a folder of checkpoints
    (["export", "{tmp}/ckroot/step_00000002", "--out", "{tmp}/o"], "CHECKPOINT"),  # no manifest
    (["export", "{assets}/corrupt/step_00000001", "--out", "{tmp}/o"], "CHECKPOINT"),  # fails its checksum
    (["export", "{assets}/moe/step_00000001", "--out", "{tmp}/o"], "CHECKPOINT"),  # MoE GPT: no Llama
    (["export", "{assets}/gpt/step_00000001", "--format", "gguf", "--out", "{tmp}/o"], "--format"),
    (["export", "{assets}/gpt/step_00000001", "--out", "{tmp}"], "--out"),  # not empty
    (["export", "{assets}/gpt/step_00000001", "--out", "{tmp}/a_file"], "--out"),
    (["export", "{assets}/gpt/step_00000001", "--out", UNWRITABLE], "--out"),
    (["export", "{assets}/gpt/step_00000001", "--out", "{tmp}/o", "--dtype", "fp8"], "--dtype"),
    (["export", "{assets}/gpt/step_00000001", "--out", "{tmp}/o", "--shard-mb", "0"], "--shard-mb"),
    (["export", "{assets}/gpt/step_00000001", "--out", "{tmp}/o", "--config", "{assets}/llama256.json"],
     "--config"),  # a reference GPT's checkpoint has no Hugging Face config
    # data prepare
    (["data", "prepare", "{tmp}/a_file", "--out", "{tmp}/o"], "--tokenizer"),
    (["data", "prepare", "{tmp}/missing", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}/o"], "INPUT"),
    (["data", "prepare", "{tmp}/ckroot", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}/o"], "INPUT"),
    (["data", "prepare", "{tmp}/not_json.jsonl", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}/o"],
     "INPUT"),
    (["data", "prepare", "{tmp}/good.jsonl", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}/o"],
     "--field"),  # no "text" in its records
    (["data", "prepare", "{tmp}/a_file", "--tokenizer", "{tmp}/missing.json", "--out", "{tmp}/o"], "--tokenizer"),
    (["data", "prepare", "{tmp}/a_file", "--tokenizer", "{tmp}/not_json.jsonl", "--out", "{tmp}/o"],
     "--tokenizer"),
    (["data", "prepare", "{tmp}/a_file", "--tokenizer", "stdlib-bpe-100", "--out", "{tmp}/o"], "--tokenizer"),
    (["data", "prepare", "{tmp}/a_file", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}/o",
      "--model-config", "{assets}/llama256.json"], "--model-config"),  # 300 ids, 256 embeddings
    (["data", "prepare", "{tmp}/a_file", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}/o",
      "--recipe", "{tmp}/tiny.toml"], "--recipe"),
    (["data", "prepare", "{tmp}/a_file", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}/o",
      "--model-config", "{assets}/llama256.json", "--recipe", "{tmp}/tiny.toml"], "--model-config"),
    (["data", "prepare", "{tmp}/a_file", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}"], "--out"),
    (["data", "prepare", "{tmp}/a_file", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}/a_file"], "--out"),
    (["data", "prepare", "{tmp}/a_file", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}/o",
      "--val-fraction", "1"], "--val-fraction"),
    (["data", "prepare", "{tmp}/a_file", "--tokenizer", "{assets}/bpe300.json", "--out", "{tmp}/o",
      "--workers", "0"], "--workers"),
    # train: zero-bubble pipeline schedules (tessel.config._check_zbv)
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.schedule="zb-h3"'], "parallel.schedule"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="zb-h1"', "--set",
      "parallel.virtual_stages=2", "--set", "model.n_layer=4"], "parallel.virtual_stages"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="zbv"', "--set",
      "model.n_layer=4"], "parallel.virtual_stages"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="zbv"', "--set",
      "parallel.virtual_stages=2", "--set", "model.n_layer=4"], "parallel.micro_batches"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="zbv"', "--set",
      "parallel.virtual_stages=2", "--set", "parallel.micro_batches=2", "--set", "model.n_layer=4", "--set",
      "model.tie_embeddings=true"], "model.tie_embeddings"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="zb-h1"', "--set",
      "parallel.recompute=true"], "parallel.recompute"),
    # train: asynchronous pipelines (tessel.config._check_async)
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="2bw"', "--set",
      "parallel.micro_batches=2"], "parallel.allow_async"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="pipedream"', "--set",
      "parallel.micro_batches=2", "--set", "parallel.allow_async=true"], "train.grad_clip"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="2bw"', "--set",
      "parallel.allow_async=true"], "parallel.micro_batches"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="2bw"', "--set",
      "parallel.micro_batches=2", "--set", "parallel.allow_async=true", "--set", "checkpoint.every=5"],
     "checkpoint.every"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="2bw"', "--set",
      "parallel.micro_batches=2", "--set", "parallel.allow_async=true", "--set", "parallel.vertical_sync=true"],
     "parallel.vertical_sync"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.pp=2", "--set", 'parallel.schedule="2bw"', "--set",
      "parallel.micro_batches=2", "--set", "parallel.allow_async=true", "--set", "parallel.zero_stage=1", "--set",
      "parallel.dp=2"], "parallel.schedule"),
    # launch slurm (the tiny recipe's layout is dp=2)
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--procs-per-node", "2", "--set", "checkpoint.every=5"],
     "--nodes"),  # 4 ranks for a layout of 2
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "0", "--procs-per-node", "2"], "--nodes"),
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2"], "--gpus-per-node"),  # neither GPUs nor processes
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--gpus-per-node", "1", "--procs-per-node", "1"],
     "--gpus-per-node"),
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--procs-per-node", "1"], "checkpoint.every"),
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--procs-per-node", "1", "--set", "checkpoint.every=5",
      "--set", 'runtime.device="cuda"'], "runtime.device"),
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--procs-per-node", "1", "--set", "checkpoint.every=5",
      "--time", "1:2:3:4"], "--time"),
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--procs-per-node", "1", "--set", "checkpoint.every=5",
      "--time", "2", "--grace", "120"], "--grace"),  # the stop would come before the start
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--procs-per-node", "1", "--set", "checkpoint.every=5",
      "--job-name", "my job"], "--job-name"),
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--procs-per-node", "1", "--set", "checkpoint.every=5",
      "--port", "80"], "--port"),
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--procs-per-node", "1", "--set", "checkpoint.every=5",
      "--sbatch-arg", "qos=high"], "--sbatch-arg"),
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--procs-per-node", "1", "--set", "checkpoint.every=5",
      "--out", "{tmp}"], "--out"),
    (["launch", "slurm", "{tmp}/tiny.toml", "--nodes", "2", "--procs-per-node", "1", "--set", "checkpoint.every=5",
      "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/oov.bin"'], "data.path"),
    # logging.trackers
    (["train", "{tmp}/tiny.toml", "--set", 'logging.trackers=["neptune"]'], "logging.trackers"),
    (["train", "{tmp}/tiny.toml", "--set", 'logging.trackers=["mlflow", "mlflow"]'], "logging.trackers"),
    (["train", "{tmp}/tiny.toml", "--set", "logging.tensorboard=false", "--set", 'logging.trackers=["tensorboard"]'],
     "logging.tensorboard"),
    (["train", "{tmp}/tiny.toml", "--set", 'logging.wandb_mode="cloud"'], "logging.wandb_mode"),
    # launch k8s
    (["launch", "k8s", "{tmp}/tiny.toml", "--nodes", "2", "--gpus-per-node", "2", "--image", "img",
      "--set", "checkpoint.every=5"], "--nodes"),
    (["launch", "k8s", "{tmp}/tiny.toml", "--nodes", "2", "--gpus-per-node", "1", "--set", "checkpoint.every=5"],
     "--image"),
    (["launch", "k8s", "{tmp}/tiny.toml", "--nodes", "2", "--gpus-per-node", "1", "--image", "img"],
     "checkpoint.every"),
    (["launch", "k8s", "{tmp}/tiny.toml", "--nodes", "2", "--gpus-per-node", "1", "--image", "img",
      "--set", "checkpoint.every=5", "--name", "Tiny_Run"], "--name"),
    (["launch", "k8s", "{tmp}/tiny.toml", "--nodes", "2", "--gpus-per-node", "1", "--image", "img",
      "--set", "checkpoint.every=5", "--storage", "lots"], "--storage"),
    (["launch", "k8s", "{tmp}/tiny.toml", "--nodes", "2", "--gpus-per-node", "1", "--image", "img",
      "--set", "checkpoint.every=5", "--pvc", "Runs!"], "--pvc"),
    (["launch", "k8s", "{tmp}/tiny.toml", "--nodes", "2", "--gpus-per-node", "1", "--image", "img",
      "--set", "checkpoint.every=5", "--max-restarts", "-1"], "--max-restarts"),
    (["launch", "k8s", "{tmp}/tiny.toml", "--nodes", "2", "--gpus-per-node", "1", "--image", "img",
      "--set", "checkpoint.every=5", "--out", "{tmp}"], "--out"),
    # train: re-planning and emulated devices (tessel.elastic.replan, tessel.models.emulated)
    (["train", "{tmp}/tiny.toml", "--set", 'fault.replan="everything"'], "fault.replan"),
    (["train", "{tmp}/tiny.toml", "--set", 'fault.replan="full"', "--set", 'parallel.dp_arch="ps"'], "fault.replan"),
    (["train", "{tmp}/tiny.toml", "--set", "runtime.emulate_flops=0"], "runtime.emulate_flops"),
    # train and plan: heterogeneous devices (tessel.planner.hetero, tessel.parallel.data.uneven)
    (["train", "{tmp}/tiny.toml", "--set", "runtime.device_speeds=[1.0, 2.0, 3.0]"], "runtime.device_speeds"),
    (["train", "{tmp}/tiny.toml", "--set", "runtime.device_speeds=[1.0, -2.0]"], "runtime.device_speeds"),
    (["train", "{tmp}/tiny.toml", "--set", "runtime.device_memory_gib=[8.0]"], "runtime.device_memory_gib"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.dp_shares=[1, 2]"], "parallel.dp_shares"),  # sum != 2
    (["train", "{tmp}/tiny.toml", "--set", "parallel.dp_shares=[2]"], "parallel.dp_shares"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.dp_split="speed"', "--set", "parallel.zero_stage=2"],
     "parallel.dp_split"),  # ZeRO-2 reduces per micro-batch: a rank with fewer would leave the others waiting
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.dp_split="fast"'], "parallel.dp_split"),
    (["plan", "--world", "8", "--set", "cluster.speeds=1,2"], "cluster.speeds"),  # one per device
    (["plan", "--world", "2", "--set", "cluster.speeds=1,x"], "cluster.speeds"),
    # train: slow ranks (tessel.train.fault.slow)
    (["train", "{tmp}/tiny.toml", "--set", 'fault.slow_policy="kill"'], "fault.slow_policy"),
    (["train", "{tmp}/tiny.toml", "--set", "fault.slow_window=1"], "fault.slow_window"),
    (["train", "{tmp}/tiny.toml", "--set", "fault.slow_factor=1.0"], "fault.slow_factor"),
    (["train", "{tmp}/tiny.toml", "--set", 'fault.slow_policy="evict"', "--set", 'parallel.dp_arch="ps"'],
     "fault.slow_policy"),
    (["train", "{tmp}/tiny.toml", "--set", 'fault.slow_policy="rebalance"', "--set", "parallel.pp=2",
      "--set", "parallel.dp=1", "--set", "parallel.zero_stage=1"], "fault.slow_policy"),  # no checkpoint to go on from
    # train: context parallelism (tessel.config._check_context_parallel)
    (["train", "{tmp}/tiny.toml", "--set", "parallel.cp=0"], "parallel.cp"),
    (["train", "{tmp}/tiny.toml", "--set", 'parallel.cp_mode="star"'], "parallel.cp_mode"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.cp=3"], "train.seq_len"),  # 16 tokens, 6 chunks
    (["train", "{tmp}/tiny.toml", "--set", "parallel.cp=2", "--set", "parallel.tp=4", "--set",
      "parallel.sequence_parallel=true", "--set", "train.seq_len=20"], "train.seq_len"),  # 10 a cp rank, tp4
    (["train", "{tmp}/tiny.toml", "--set", "parallel.cp=8", "--set", 'parallel.cp_mode="ulysses"'],
     "parallel.cp"),  # 4 heads over 8 ranks
    (["train", "{tmp}/tiny.toml", "--set", "parallel.cp=4", "--set", 'parallel.cp_mode="ulysses"', "--set",
      "model.n_kv_head=2"], "parallel.cp"),  # 2 kv heads over 4 ranks
    (["train", "{tmp}/tiny.toml", "--set", "parallel.cp=2", "--set", 'parallel.tp_mode="2d"', "--set",
      "parallel.tp=4"], "parallel.cp"),
    (["train", "{tmp}/tiny.toml", "--set", "parallel.cp=2", "--set", "parallel.dp=1", "--set",
      "runtime.nproc_per_node=1"], "runtime.nproc_per_node"),  # the world is cp*... = 2
    (["train", "{tmp}/tiny.toml", "--set", "parallel.cp=2", "--set", "parallel.pp=2", "--set",
      'parallel.pp_balance="time"'], "parallel.pp_balance"),  # times whole sequences through chunk attention
]


@pytest.fixture
def tmp(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    Topology(world_size=2, nodes=[[0, 1]]).save(tmp_path / "topology2.json")
    write_recipe(tmp_path / "tiny.toml", "parallel.dp=2", f'logging.out_dir="{tmp_path / "out"}"')
    (tmp_path / "latin1.toml").write_bytes("[model]\n# caf\xe9\nn_layer = 2\n".encode("latin-1"))
    (tmp_path / "ckroot" / "step_00000002").mkdir(parents=True)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text(FILES["good.jsonl"])
    tokens = np.arange(1000, dtype=np.uint16) % 256
    tokens.tofile(tmp_path / "train.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(tokens.tobytes()[:-1])
    tokens[:10].tofile(tmp_path / "short.bin")
    np.where(np.arange(1000) == 500, 300, tokens).astype(np.uint16).tofile(tmp_path / "oov.bin")
    return tmp_path


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Files some rows need that cost more than a write: checkpoints (a tiny GPT, an MoE GPT, a corrupt
    copy), weights missing a tensor, a 300-id BPE, a Llama config of 256 ids, a Mixtral recipe with its router
    loss; made once per module."""
    import shutil

    from safetensors.torch import save_file

    from tessel.config import ModelConfig, to_toml
    from tessel.models.build import build_model
    from tessel.models.gpt import GPT
    from tessel.train.tokenizer import train_bpe
    from tests.helpers import TINY, build_trainer, tiny_config
    root = tmp_path_factory.mktemp("assets")
    for name, extra in (("gpt", []), ("moe", ["model.n_experts=2"])):
        build_trainer(tiny_config(*extra, "train.steps=1", "train.warmup_steps=0", "checkpoint.every=1",
                                  "fault.heartbeat_s=0", f'checkpoint.dir="{root / name}"'))[0].fit()
    shutil.copytree(root / "gpt", root / "corrupt")
    shard = next((root / "corrupt" / "step_00000001").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))
    state = GPT(ModelConfig(**TINY["model"])).state_dict()
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(root / "gpt-no-head.safetensors"))
    (root / "corpus.txt").write_text("".join(f"def f{i}(x): return x + {i * 7 % 101}  # n{i % 37}\n"
                                             for i in range(500)))
    train_bpe(root / "corpus.txt", 300, root / "bpe300.json")
    (root / "llama256.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
                                                    "intermediate_size": 64, "num_hidden_layers": 2,
                                                    "num_attention_heads": 4, "max_position_embeddings": 32}))
    (root / "llama.toml").write_text(to_toml(tiny_config(f'model.hf_config="{root / "llama256.json"}"')))
    (root / "mixtral-router.json").write_text(json.dumps({
        "model_type": "mixtral", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "max_position_embeddings": 32, "num_local_experts": 4, "output_router_logits": True}))
    (root / "mixtral.toml").write_text(to_toml(tiny_config(f'model.hf_config="{root / "mixtral-router.json"}"')))
    llama = build_model(ModelConfig(hf_config=str(root / "llama256.json"))).state_dict()
    save_file({k: v for k, v in llama.items() if k != "model.norm.weight"}, str(root / "llama-no-norm.safetensors"))
    return root


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test on any new process: torchrun (_standalone), subprocesses, multiprocessing."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a process was spawned for a bad input")
    monkeypatch.setattr(tessel.commands.cli, "_standalone", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", forbidden)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """tessel.commands.cli.main in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        tessel.commands.cli.main(argv)
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def filled(argv: list[str], tmp, assets=None) -> list[str]:
    return [a.format(tmp=tmp, assets=assets) for a in argv]


def assert_refused(code: int, out: str, err: str, field: str) -> None:
    lines = err.splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert field in lines[0], lines[0]
    assert "Traceback" not in out + err


@pytest.mark.parametrize("argv,field", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_refused_in_one_line(argv, field, tmp, assets, no_spawn, capsys):
    assert_refused(*run_cli(filled(argv, tmp, assets), capsys), field)


def test_the_table_covers_every_command():
    assert len(BAD) >= 30
    assert {a[0] for a, _ in BAD} >= {"train", "plan", "simulate", "probe", "bench", "plot", "export", "data",
                                      "launch"}


REAL = [  # the installed entry point, in a process of its own
    (["plan", "--world", "0"], "--world"),
    (["plan", "--world", "abc"], "--world"),
    (["bench", "comm", "--sizes", "1X"], "--sizes"),
    (["plot", "{tmp}/not_json.jsonl"], "METRICS"),
    (["train", "{tmp}/tiny.toml", "--set", 'logging.out_dir="{tmp}/used"'], "logging.out_dir"),
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/oov.bin"'],
     "data.path"),
]


@pytest.mark.parametrize("argv,field", REAL, ids=[" ".join(a) for a, _ in REAL])
def test_real_entry_point_prints_one_line(argv, field, tmp):
    proc = subprocess.run([sys.executable, "-m", "tessel", *filled(argv, tmp)], capture_output=True,
                          text=True, timeout=120)
    assert_refused(proc.returncode, proc.stdout, proc.stderr, field)


# valid inputs still run: to the end, or up to the process they spawn


def test_plan_json_exits_0(capsys):
    code, out, _ = run_cli(["plan", "--model", "gpt3-1.3b", "--world", "16", "--json"], capsys)
    assert code == 0 and json.loads(out)["world"] == 16


def test_plot_writes_a_png(tmp, capsys):
    png = tmp / "new" / "curves.png"
    code, out, _ = run_cli(["plot", str(tmp / "good.jsonl"), "--out", str(png)], capsys)
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [
    ["bench", "comm", "--world", "2", "--sizes", "4K,1.5M", "--node-size", "1", "--json", "{tmp}/b/rows.json"],
    ["bench", "comm", "--world", "2", "--ops", "all_reduce", "--algorithms", "ring", "--topology",
     "{tmp}/topology2.json"],
    ["probe", "--world", "2", "--out", "{tmp}/t/topology.json"],
])
def test_valid_flags_reach_the_launch(argv, tmp, monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(tessel.commands.cli, "_standalone", lambda nproc: launched.append(nproc) or 0)
    code, _, err = run_cli(filled(argv, tmp), capsys)
    assert (code, err, launched) == (0, "", [2])


def test_help_still_exits_0(capsys):
    code, out, _ = run_cli(["plan", "--help"], capsys)
    assert code == 0 and "--world" in out
