"""Generation: the vLLM engine wrapper (engine), the same engine as a server process
of its own (server), its client (client) and their typed protocol (messages), and
bounded-staleness admission with per-token policy versions (staleness).

May import: workers.models, workers.rewards, workers.weights, workers.spec, workers.tasks,
workers.io. Never workers.train: the two roles meet only in workers.coord.
"""
