"""Data parallelism: a bucketed all-reduce of gradients overlapped with backward, and its reducers."""
