"""The policy update: losses and advantages (algorithms), the DeepSpeed trainer of one
process (trainer), its value model (critic), the trainer's data-parallel ranks, one
process each (ranks; a rank's side: rank_process; their pipe protocol: rank_messages),
and the KL reference as an inference-stage worker (reference).

May import: workers.models, workers.rewards, workers.weights, workers.spec, workers.tasks,
workers.io. Never workers.rollout: the two roles meet only in workers.coord.
"""
