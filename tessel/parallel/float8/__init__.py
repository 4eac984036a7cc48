"""train.precision = "fp8": the transformer blocks' matmuls in float8 through torchao's float8 training.

device.py says whether a device multiplies in float8 (else torchao emulates it); matmul.py is the float8
matmul every linear layer of a block calls (an nn.Linear, or a tensor-parallel shard's); apply.py is
tessel.apply's step that switches the blocks' layers to it.
"""
