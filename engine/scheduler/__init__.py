"""Continuous batching with chunked prefill: pure CPU logic, no tensors."""
from engine.scheduler.batch import ScheduledBatch, ScheduledSeq, StepRecord
from engine.scheduler.scheduler import Scheduler

__all__ = ["ScheduledBatch", "ScheduledSeq", "Scheduler", "StepRecord"]
