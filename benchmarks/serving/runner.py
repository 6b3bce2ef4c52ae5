"""One phase of load: items start at their arrival offsets (capped by the concurrency limit), the turns of a
conversation run in order, and the phase stops at --max-duration: requests still in flight are cancelled and
counted as ``deadline`` errors, items not started yet as ``not_sent``."""
from __future__ import annotations

import asyncio
import math
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

from tqdm import tqdm

from benchmarks.serving.arrival import start_offsets
from benchmarks.serving.client import Client, RequestRecord
from benchmarks.serving.config import LoadConfig
from benchmarks.serving.workloads import Item


@dataclass
class PhaseRun:
    rate: float
    concurrency: int | None
    records: list[RequestRecord]
    duration: float
    hit_deadline: bool


def phase_name(rate: float, concurrency: int | None) -> str:
    r = "inf" if math.isinf(rate) else f"{rate:g}"
    return f"rate={r}" + (f" conc={concurrency}" if concurrency else "")


async def run_phase(client: Client, items: list[Item], rate: float, concurrency: int | None, load: LoadConfig,
                    seed: int, progress: bool) -> PhaseRun:
    offsets = start_offsets(len(items), rate, load.arrival, seed, load.burst_size)
    per_item = [[RequestRecord(it.index, k, t.tag, t.output_len) for k, t in enumerate(it.turns)] for it in items]
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=sum(len(r) for r in per_item), desc=phase_name(rate, concurrency), unit="req",
               file=sys.stderr, disable=not progress, dynamic_ncols=True)
    failures = [0]
    t0 = time.perf_counter()

    async def run_item(item: Item, offset: float, recs: list[RequestRecord]) -> None:
        wait = t0 + offset - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        async with AsyncExitStack() as stack:
            if sem is not None:
                await stack.enter_async_context(sem)
            answers: list[str] = []
            for k, rec in enumerate(recs):
                await client.send(rec, client.payload(item, k, answers), t0)
                bar.update(1)
                if not rec.ok:
                    failures[0] += 1
                    bar.set_postfix(errors=failures[0], refresh=False)
                    return  # later turns need this answer; they stay not_sent
                answers.append(rec.text)

    tasks = [asyncio.ensure_future(run_item(it, off, recs)) for it, off, recs in zip(items, offsets, per_item)]
    try:
        _, pending = await asyncio.wait(tasks, timeout=load.max_duration)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        bar.close()
    duration = time.perf_counter() - t0
    records = [r for recs in per_item for r in recs]
    for rec in records:
        if rec.sent and not rec.ok and rec.error is None:
            rec.fail("deadline", f"still running when --max-duration {load.max_duration}s ended the phase")
    for task in tasks:  # a bug in the tool itself must not pass silently
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return PhaseRun(rate, concurrency, records, duration, bool(pending))
