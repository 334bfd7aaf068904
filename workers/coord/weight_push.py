"""The trainer's weights to the live engines by ``rollout.weight_transport``: a file sent
to each engine (rpc), or a collective broadcast over the weight group (collective)."""
from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable
from typing import Optional

from workers.api import TrainEngine
from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_types import UpdateTiming
from workers.weights.broadcast import RankZeroSender, WeightBroadcaster
from workers.weights.files import trainer_weight_file
from workers.weights.update import FileWeights, WeightUpdate
from workers.weights.weight_group import WeightBroadcastError

logger = logging.getLogger(__name__)


class WeightPush:
    """``broadcaster``: the weight group (collective transport, once open); ``update_bytes``:
    what the last update sent to each engine (weights/update_bytes); ``retire(engine,
    why)``: the fleet takes an engine that died during an update out of service."""

    def __init__(self, retire: Callable[[RolloutEngine, str], None]):
        self.retire = retire
        self.broadcaster: Optional[WeightBroadcaster] = None
        self.update_bytes: Optional[int] = None

    async def _update(self, engine: RolloutEngine, weights: WeightUpdate, version: int) -> Optional[UpdateTiming]:
        """Push an update (weights/update.py) to one engine; None if it died (it is
        retired; the others go on)."""
        try:
            return await engine.update_weights(weights, version)
        except Exception:
            if not engine.dead:
                raise
            self.retire(engine, "weight updates skip it")
            return None

    async def send(self, engines: list[RolloutEngine], trainer: TrainEngine, version: int) -> list:
        """The trainer's weights to every live engine by ``rollout.weight_transport``; the
        timings of the engines that took them."""
        if self.broadcaster is None:  # a file, sent to each engine in bounded chunks (weights/files.py)
            with tempfile.TemporaryDirectory(prefix="fluxrl-weights-") as folder:
                weights = FileWeights.of(await asyncio.to_thread(trainer_weight_file, trainer, folder, version))
                self.update_bytes = weights.size  # model.lora: the adapter's file alone
                results = await asyncio.gather(*(self._update(e, weights, version) for e in list(engines)))
            return [t for t in results if t is not None]
        remote = isinstance(self.broadcaster.sender, RankZeroSender)
        # in this process: the full weights (a collective of the ranks under ZeRO-3); with
        # rank 0 sending, it gathers them itself
        state = None if remote else await asyncio.to_thread(trainer.state_dict)
        if state is not None:
            self.update_bytes = sum(t.numel() * t.element_size() for t in state.values())
        while True:
            if self.broadcaster.engines != engines:
                # A member died (retired) and broke the group: form it again with the live
                # engines (those that got this version already reload the same weights).
                if not engines:
                    return []  # every engine died: the run fails where it next needs one
                logger.warning("weight group formed again with %d live engine(s)", len(engines))
                await self.broadcaster.open(engines)
            members = list(self.broadcaster.engines)
            try:
                results = await self.broadcaster.broadcast(state, version, update=self._update)
                return [t for t in results if t is not None]
            except WeightBroadcastError:
                if not any(e.dead for e in members):
                    raise
