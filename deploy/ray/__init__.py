"""SplitServe on a Ray cluster: ``python -m deploy.ray.launch`` (see docs/deploy.md)."""
