"""Typed, validated configuration: the recipe's schema (tessel.config.schema), reading and writing recipes
(tessel.config.io), and the rules that tie sections together (tessel.config.rules, run by
tessel.config.check). Torch-free: `import tessel.config` loads neither torch nor transformers."""

from tessel.config.schema import (CheckpointConfig, Config, DataConfig, FaultConfig, LoggingConfig, ModelConfig,
                                  ParallelConfig, RuntimeConfig, Strict, TrainConfig, compute_bytes,
                                  compute_dtype)
from tessel.config.check import check_layout
from tessel.config.flags import at_least, output_file
from tessel.config.io import apply_overrides, build_config, load_config, parse_override, to_toml
from tessel.config.rules.data import BPE_VOCAB, builtin_bpe_vocab, check_tokenizer
from tessel.config.rules.hf import hf_pp_refusal, hf_tp_refusal
from tessel.config.rules.tensor_nd import tp_grid_refusal
from tessel.errors import ConfigError

__all__ = ["BPE_VOCAB", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "FaultConfig", "LoggingConfig",
           "ModelConfig", "ParallelConfig", "RuntimeConfig", "Strict", "TrainConfig", "apply_overrides", "at_least",
           "build_config", "builtin_bpe_vocab", "check_layout", "check_tokenizer", "compute_bytes", "compute_dtype", "hf_pp_refusal", "hf_tp_refusal",
           "load_config", "output_file", "parse_override", "to_toml", "tp_grid_refusal"]
