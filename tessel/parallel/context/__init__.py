"""Context parallelism: each sequence split over the cp ranks, attention computed across them.

layout.py (which tokens each rank holds), kernel.py (one block of attention with
its log-sum-exp, and its backward), ring.py (ring attention, Liu et al. 2023),
ulysses.py (the all-to-all of DeepSpeed-Ulysses, Jacobs et al. 2023),
context.py (CPContext: the group, the mode, this rank's positions), apply.py
(the reference GPT's attention core and a Hugging Face Llama's, Mixtral's or GPT-2's
attention under cp), moe.py (MoE blocks: capacity and balance statistics of the
whole sequences).
"""
