"""The decode role: reserves pages for each prompt, has a prefill worker fill them, then decodes in
continuous batches and streams tokens from the first one on."""
