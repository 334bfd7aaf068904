"""Running one RL job: the controller that wires the roles together and runs a schedule.

- controller: ``Controller`` (set-up, the training step, evaluation, ``run()``), ``RunResult``;
- processes: placement, starting and stopping the trainer, engines, node agents;
- generation: the rollout fleet (dispatch, groups, engines that hand off or die, weights);
- sync_schedule, async_schedule: the two schedules, each stating what it guarantees;
- checkpointing: checkpoints and --resume (state.pt);
- step_metrics: the per-step report, busy/idle accounting;
- scheduling: the order prompts are dispatched in; length_ranker: the online
  output-length ranker.

May import everything below it; only workers.cli imports it.
"""
