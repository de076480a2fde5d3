"""Command lines (layer L5): thin absl front ends over the Python API."""
