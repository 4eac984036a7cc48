"""The output head and the cross-entropy fused, chunked over tokens (train.fused_loss): kernel.py (the autograd
function, vocabulary-parallel under tp), apply.py (the head's forward hands out its input; the loss, and the
logits for sampling, hold the head)."""
