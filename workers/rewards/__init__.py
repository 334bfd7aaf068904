"""Scoring completions: the operating-system sandbox that runs a team's reward code
(sandbox) and the scoring service that mixes built-in and user rewards (service).

May import: workers.spec, workers.tasks, workers.io.
"""
