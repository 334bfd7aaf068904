"""Moving policy weights from the trainer to the rollout engines: serialization and the
vLLM worker extension that loads them (sync), and the collective transport, a weight group
over gloo or NCCL (broadcast).

May import: workers.spec, workers.io.
"""
