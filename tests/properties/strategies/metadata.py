"""Hypothesis strategies for metadata."""
