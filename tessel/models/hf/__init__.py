"""Hugging Face transformers models in tessel: their shape, how they are built, and where each axis cuts them."""
