"""Agentic RL: multi-turn episodes in which the policy calls tools or talks to an
environment, trained token-exact on what the engine generated (docs/guides/agentic.md).

- api: the environment protocol and what an episode records;
- episode: the turn loop over a rollout engine; render: observations through the chat template;
- tools: tool calls parsed from a turn, the calculator and the sandboxed Python tool;
- builtin: the built-in environments; sandboxed: a team's environment in the OS sandbox.

May import: workers.rollout, workers.models, workers.rewards, workers.weights, workers.spec,
workers.tasks, workers.io. Never workers.train or workers.coord (coord runs episodes). ``api`` imports nothing of
FluxRL's and sits beside workers.spec, so a rollout Completion can carry an episode's record.
"""
