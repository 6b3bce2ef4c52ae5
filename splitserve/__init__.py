"""The ``splitserve`` command, above every other part: it only dispatches to the engine (tiny-model), the local
launcher (up) and the load tool (bench)."""
