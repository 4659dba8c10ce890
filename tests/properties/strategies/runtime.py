"""Hypothesis strategies for runtime."""
