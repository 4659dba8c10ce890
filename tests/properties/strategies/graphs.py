"""Hypothesis strategies for graphs."""
