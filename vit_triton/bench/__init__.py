"""Measurement: correctness checks against PyTorch, and (later) timing against the peers."""
