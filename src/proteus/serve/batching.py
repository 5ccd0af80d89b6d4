"""Dynamic micro-batching: the images of concurrent requests predicted together in one worker thread.

One learner runs one forward at a time (the adapted backbone holds per-call composition state), so
requests cannot run their forwards side by side. Instead each request puts a :class:`Job` (its decoded,
transformed images) on a queue; one worker thread takes every job waiting, runs them as one batch of at
most ``max_batch`` images per :meth:`~proteus.Proteus.predict` call and hands each job its own rows. The
fixed cost of a forward (Python, retrieval over the tasks, the key scores) is paid once per batch rather
than once per request, so N requests arriving together cost little more than one batch of N images.
Nobody waits for a batch to fill: the worker starts as soon as one job is waiting, and jobs that arrive
meanwhile make the next batch.

Jobs of different learners (a reload swapped one in meanwhile) are never mixed: each runs with the learner
its request started with. A row depends on its own image only (docs/predict.md; tested), so which other
requests share a batch changes nothing beyond float round-off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch

from proteus.engine.records import Prediction
from proteus.experiment.predictions import prediction_rows
from proteus.learners import ContinualLearner

log = logging.getLogger("proteus")

__all__ = ["Job", "MicroBatcher"]


@dataclass
class Job:
    """One request's images: ``x`` (N, C, H, W) from ``clf.transform_images``, their ``names`` (the rows'
    ``file``) and ``top_k``; :attr:`future` gets the rows (or the exception), on the request's loop."""

    clf: ContinualLearner
    x: torch.Tensor
    names: list[str]
    top_k: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[dict[str, Any]]]
    cancelled: bool = False  # the request gave up (timeout, client gone): skip it if not started

    def settle(self, rows: list[dict[str, Any]] | None, error: BaseException | None = None) -> None:
        """Hand the result to the waiting request (thread-safe; a request that is gone is skipped)."""

        def done() -> None:
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(rows or [])

        try:
            self.loop.call_soon_threadsafe(done)
        except RuntimeError:  # the event loop closed: the server stopped
            pass


def _cat(preds: list[Prediction]) -> Prediction:
    if len(preds) == 1:
        return preds[0]
    parts: dict[str, Any] = {}
    for f in dataclasses.fields(Prediction):
        values = [getattr(p, f.name) for p in preds]
        parts[f.name] = None if values[0] is None else torch.cat(values)
    return Prediction(**parts)


def _slice(pred: Prediction, a: int, b: int) -> Prediction:
    parts: dict[str, Any] = {
        f.name: (v if (v := getattr(pred, f.name)) is None else v[a:b]) for f in dataclasses.fields(pred)
    }
    return dataclasses.replace(pred, **parts)


class MicroBatcher:
    """The worker thread of the module docstring: :meth:`submit` a job, await its future.

    ``batches``, ``images`` and ``largest`` count the forwards' batches, their images and the largest
    batch so far (how much batching the traffic allows; ``GET /health`` shows them)."""

    def __init__(self, max_batch: int = 32) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1; got {max_batch}")
        self.max_batch = max_batch
        self.batches = self.images = self.largest = 0
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="proteus-serve-batcher", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Finish the jobs already queued, then end the worker thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60)
            self._thread = None

    def submit(self, job: Job) -> None:
        """Queue ``job`` for the next batch (the worker starts on the first job if the app's lifespan did
        not start it: an ASGI server without lifespan events)."""
        self.start()
        self._queue.put(job)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            jobs, stop = [first], first is None
            while True:  # everything waiting now joins this round
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                stop = stop or job is None
                jobs.append(job)
            live = [j for j in jobs if j is not None and not j.cancelled]
            for clf in dict.fromkeys(j.clf for j in live):  # one group per learner, in arrival order
                self._predict([j for j in live if j.clf is clf])
            if stop:
                return

    def _predict(self, jobs: list[Job]) -> None:
        """Predict the jobs of one learner in batches of at most ``max_batch`` images; settle each job."""
        clf = jobs[0].clf
        try:
            x = torch.cat([j.x for j in jobs]) if len(jobs) > 1 else jobs[0].x
            preds = []
            for a in range(0, len(x), self.max_batch):
                chunk = x[a : a + self.max_batch]
                preds.append(clf.predict(chunk))
                self.batches += 1
                self.images += len(chunk)
                self.largest = max(self.largest, len(chunk))
            pred = _cat(preds)
        except Exception as e:  # noqa: BLE001 - every job of the batch gets the error (a 500), the worker goes on
            log.exception("serve: prediction of a batch of %d requests failed", len(jobs))
            for j in jobs:
                j.settle(None, e)
            return
        a = 0
        for j in jobs:
            b = a + len(j.x)
            try:
                j.settle(prediction_rows(clf, _slice(pred, a, b), j.names, top_k=j.top_k))
            except Exception as e:  # noqa: BLE001
                log.exception("serve: building the rows of a request failed")
                j.settle(None, e)
            a = b
