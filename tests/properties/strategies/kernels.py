"""Hypothesis strategies for kernels."""
