"""The ``schedule`` and ``stop`` sections: when a step trains, which prompts go where, and
when the run ends."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from workers.spec.base import MAX_RUN_MINUTES, _Strict


class LongTailSpec(_Strict):
    """schedule.dispatch skew_aware: the long-tail engines and the requests' priorities."""
    share: float = Field(0.1, gt=0, lt=1, description="the share of prompt groups, by predicted length against "
                         "the recent predictions, that go to the long-tail engines")
    engines: Optional[int] = Field(None, ge=1, description="long-tail engines; default: chosen after every step "
                                   "from the two roles' measured tokens per second, so that both pools finish "
                                   "their predicted tokens together (at least 1, and 1 less than the engines)")
    aging: Optional[int] = Field(None, ge=0, description="vLLM priority: a predicted-short group waits behind at "
                                 "most this many groups dispatched after it; default: schedule.batch_prompts")
    max_num_seqs: Optional[int] = Field(None, ge=1, description="with engines set (a fixed split): the long-tail "
                                        "engines' own vLLM max_num_seqs, a small batch configured for latency as "
                                        "StreamRL's; default: rollout.max_num_seqs (their batch is then small because "
                                        "only the predicted-longest share reaches them)")

    @model_validator(mode="after")
    def _own_batch_needs_a_fixed_split(self):
        if self.max_num_seqs is not None and self.engines is None:
            raise ValueError("schedule.long_tail.max_num_seqs configures the long-tail engines when they start: set "
                             "long_tail.engines too (without it the split moves between steps)")
        return self


class ScheduleSpec(_Strict):
    mode: Literal["sync", "async"] = "async"
    max_staleness: int = Field(2, ge=0)
    batch_prompts: int = Field(8, ge=1, description="prompts per training step (x group_size samples)")
    # fifo | random | longest_first (a task order by an output-length ranker learned online
    # from the run's own samples) | skew_aware (StreamRL's skewness-aware dispatch: long-tail
    # engines, vLLM priorities with aging)
    dispatch: Literal["fifo", "random", "longest_first", "skew_aware"] = "fifo"
    long_tail: LongTailSpec = LongTailSpec()
    # sync mode only: train on each prompt group as soon as it is scored, overlapping the
    # first micro-batches with the tail of generation (StreamRL's stream generation)
    stream_train: bool = False


class StopSpec(_Strict):
    max_steps: int = Field(200, ge=1)
    max_minutes: float = Field(10.0, gt=0, le=MAX_RUN_MINUTES, description="training time at most (at most 30 "
                               "days); the evaluations before the first and after the last step are not counted, "
                               "each bounded by eval.timeout_minutes")
