"""The prefill role: chunked prefill with its own radix cache, pushing each request's finished KV pages into
the pages a decode worker reserved for it, then the first token in the aux record."""
