"""Small cases of the planner's tests (no processes, no torch): a tiny model and a one-node cluster of round
numbers, so that every expected value is arithmetic. Shared by tests/planner/test_cost.py and test_traffic.py."""

from tessel.config import ModelConfig
from tessel.planner.cluster import Cluster, Link
from tessel.planner.model_spec import from_config

TINY = ModelConfig(vocab_size=256, n_layer=2, n_head=4, d_model=32, max_seq_len=32)


def tiny_spec(layers=2, seq=16):
    return from_config(TINY.model_copy(update={"n_layer": layers}), seq, 8)


def flat_cluster(devices=8, flops=1e9, overlap=0.0, bw=1e9, lat=0.0):
    # one node, round numbers, so every expected value below is arithmetic
    link = Link(bw, lat)
    return Cluster("test", 1, devices, {"fp32": flops, "bf16": flops}, 2**40, link, link,
                   mem_bandwidth=1e9, overlap=overlap)
