"""Hypothesis strategies for prefill."""
