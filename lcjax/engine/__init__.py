"""Prefill and decode steps, sampling, the scheduler and the Engine (layer L4)."""
