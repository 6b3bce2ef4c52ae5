"""SplitServe engine core: the pieces both the prefill and the decode roles are built from."""
