"""The asynchronous schedule (``schedule.mode: async``): rollouts and training overlap.
Generation runs ahead of the trainer by at most ``schedule.max_staleness`` policy
versions; finished groups queue up and the trainer takes a batch as soon as one is there,
then pushes its weights into the running engines (``rollout.update_mode``)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Optional

from workers.agents.episode import oldest_trained_version
from workers.coord.generation import Group
from workers.coord.schedule_parts import ScheduleParts
from workers.coord.scheduling import DispatchWindow


def group_oldest_version(group: Group) -> int:
    """The version of the oldest trained (generated) token over the group's samples; the
    version it started under when it has none."""
    return min((oldest_trained_version(s.completion, group.start_version) for s in group.samples),
               default=group.start_version)


class AsyncSchedule:
    """Admission, dispatch and batching as three steps around two queues; what it guarantees:

    - Bounded staleness: a group is trained by a policy at most ``schedule.max_staleness``
      versions newer than the one that generated its oldest trained token. Admission
      (``StalenessGate``) starts a group only while the groups started fit in
      ``max_staleness + 1`` batches ahead of the trainer's version, and a finished group
      that breaks the bound anyway when its batch is assembled
      (``trainer.version - oldest > max_staleness``) is dropped (``dropped_stale``), its
      slot given back to admission. ``oldest`` is the version of the oldest generated
      token over the group's samples (``group_oldest_version``): an episode counts by its
      oldest trained token, whatever versions its later turns carry, and its observation
      tokens (never trained) do not count. A group with no generated token counts by the
      version it started under. The staleness metrics count the same way.
    - Every accepted group is trained exactly once: a finished group goes into one batch,
      or is dropped and never trained: too stale, or with ``algorithm.drop_uniform_groups``
      all its rewards equal (DAPO's dynamic sampling, ``dropped_uniform``; another group
      takes its slot). Every step trains a full batch of ``batch_prompts`` groups; a run
      that stops mid-batch trains no partial one.
    - Order: rows are dispatched by ``schedule.dispatch`` over a look-ahead window (the
      free slots plus one batch of rows); a batch takes the finished groups with the
      oldest start version first (ties in the order they finished).
    - Nothing is lost by a checkpoint: rows in flight, finished but not batched, and in
      the look-ahead window are saved as rows to redo; a resumed run generates them first.
    - A group whose generation or scoring raises fails the run (``Controller.run`` raises it).

    ``run``: the run's parts it works with (rows, fleet, gate, trainer work, training
    step, checkpoints, stop, result; schedule_parts.py)."""

    def __init__(self, run: ScheduleParts):
        self.run = run
        self.ready: asyncio.Queue[Group] = asyncio.Queue()  # finished groups, in the order they finished
        self.stash: list[Group] = []  # finished groups taken off the queue, not batched yet
        self.wake = asyncio.Event()  # admission looks again: a slot may be free
        # rows not yet started: the look-ahead window dispatch picks from, with aging
        self.waiting = DispatchWindow(run.spec.schedule.batch_prompts)
        self.pending: set[asyncio.Task] = set()  # groups generating
        self.task_rows: dict[asyncio.Task, dict] = {}
        self.counter = 0  # groups started
        self.rows: Iterator[dict] = iter(())  # the run's rows, from run_steps on

    def queue_depth(self) -> int:
        return self.ready.qsize()

    async def run_steps(self, t_start: float) -> None:
        run = self.run
        spec, self.rows = run.spec, run.rows
        producer = asyncio.create_task(self._admit())
        try:
            for step in range(run.checkpoints.first_step, spec.stop.max_steps + 1):
                if run.out_of_time(t_start):
                    break
                batch = await self._batch(t_start)
                if len(batch) < spec.schedule.batch_prompts:
                    break
                await run.train_on(batch, step, t_start)
                self.wake.set()
                if run.checkpoints.due(step) or run.checkpoints.requested:
                    await run.checkpoints.after_step(step, t_start, self._unfinished())
        finally:
            run.stop.set()
            self.wake.set()
            producer.cancel()
            for task in list(self.pending):
                task.cancel()
            await asyncio.gather(producer, *self.pending, return_exceptions=True)

    # -- admission and dispatch ----------------------------------------------------------
    async def _admit(self) -> None:
        """Start groups while the gate has free slots; wait for a change (a group finished,
        dropped or trained) before looking again."""
        gate, stop = self.run.gate, self.run.stop
        while not stop.is_set():
            free = gate.capacity - gate.finished - gate.running
            if free > 0 and not self._dispatch(free):
                return
            self.wake.clear()
            await self.wake.wait()

    def _dispatch(self, free: int) -> bool:
        """Start ``free`` groups: the look-ahead window's rows in dispatch order, each on the
        engine the plan gives it. False (the run fails) when every engine is dead."""
        run = self.run
        self.waiting.fill(free, self.rows)
        try:
            run.fleet.live_engine()  # fails clearly if every engine is dead
        except RuntimeError as exc:
            run.fail(exc)
            return False
        # aging: longest_first alone would let a predicted-short row wait forever behind longer newcomers
        plan = run.fleet.plan_indexed(list(self.waiting.rows), self.waiting.overdue(), limit=free)
        rows = self.waiting.take([d.index for d in plan])
        for row, d in zip(rows, plan):
            version = run.gate.start()
            task = asyncio.create_task(run.fleet.group(row, self.counter, version, d.engine, d.predicted,
                                                        priority=d.priority))
            self.counter += 1
            self.pending.add(task)
            self.task_rows[task] = row
            task.add_done_callback(self._finished)
        return True

    def _finished(self, task: asyncio.Task) -> None:
        """A group's task ended: its group queues up for batching, or its error fails the run."""
        self.pending.discard(task)
        self.task_rows.pop(task, None)
        self.run.gate.finish(accepted=not task.cancelled() and task.exception() is None)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self.run.fail(error)
        elif not task.cancelled():
            self.ready.put_nowait(task.result())
        self.wake.set()

    # -- batching ---------------------------------------------------------------------------
    async def _batch(self, t_start: float) -> list[Group]:
        """The next step's groups, oldest first, the dropped ones left out; fewer than
        ``batch_prompts`` only when the run stops."""
        run = self.run
        batch: list[Group] = []
        while len(batch) < run.spec.schedule.batch_prompts and not run.stop.is_set():
            if not self.stash:
                if not await self._take_finished():
                    break
                continue
            self.stash.sort(key=lambda g: g.start_version)  # oldest first keeps staleness low
            group = self.stash.pop(0)
            reason = self._drop_reason(group)
            if reason is None:
                batch.append(group)
                continue
            self._drop(reason)
            if reason == "uniform" and run.out_of_time(t_start):
                break
        return batch

    async def _take_finished(self) -> bool:
        """Wait for a finished group, then move every finished group into the stash; False
        if the run stopped first."""
        get = asyncio.create_task(self.ready.get())
        stopper = asyncio.create_task(self.run.stop.wait())
        await asyncio.wait({get, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not get.done():
            get.cancel()
            return False
        group = get.result()
        while not self.ready.empty():
            self.stash.append(self.ready.get_nowait())
        self.stash.append(group)
        return True

    def _drop_reason(self, group: Group) -> Optional[str]:
        """Why a finished group is not trained on: "stale" (it would break the staleness
        bound) or "uniform" (DAPO's dynamic sampling); None to train on it."""
        spec = self.run.spec
        if self.run.work.trainer.version - group_oldest_version(group) > spec.schedule.max_staleness:
            return "stale"
        if spec.algorithm.drop_uniform_groups and len({s.reward for s in group.samples}) == 1:
            # equal rewards give every sample a zero advantage, so the group would only thin
            # the batch's signal
            return "uniform"
        return None

    def _drop(self, reason: str) -> None:
        """Count a dropped group; its slot goes back to admission for another group."""
        result = self.run.result
        if reason == "stale":
            result.dropped_stale += 1
        else:
            result.dropped_uniform += 1
        self.run.gate.release()
        self.wake.set()

    def _unfinished(self) -> list[dict]:
        """Rows drawn but not trained on (for a checkpoint): in flight, finished but not
        batched (the queue is moved into the stash), in the look-ahead window."""
        self.stash.extend(self.ready.get_nowait() for _ in range(self.ready.qsize()))
        return list(self.task_rows.values()) + [g.samples[0].row for g in self.stash] + list(self.waiting.rows)
