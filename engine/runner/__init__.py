"""Turning a scheduled batch into tensors and running the model (no policy here)."""
