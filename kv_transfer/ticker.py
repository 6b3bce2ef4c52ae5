"""A daemon thread calling a function every `interval` seconds until stopped (deadline monitors)."""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("kv_transfer")


class Ticker:
    def __init__(self, name: str, interval: float, tick: Callable[[], None]) -> None:
        self._interval = interval
        self._tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._tick()
            except Exception:  # a monitor must outlive a bug in one tick
                log.exception("monitor tick failed")

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
