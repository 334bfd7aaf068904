"""Scoring completions: the operating-system sandbox that runs a team's reward code
(sandbox), a neural reward model in a worker process of its own (model) and the scoring
service that mixes built-in, user and reward-model rewards (service).

May import: workers.spec, workers.tasks, workers.io.
"""
