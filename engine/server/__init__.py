"""The HTTP API (OpenAI-compatible and SGLang-style /generate) over an engine."""
