"""Colossal-AI's family of tensor parallelism: 2D (SUMMA), 2.5D (Tesseract), 3D, over the tp group viewed as a grid."""
