"""Moving policy weights from the trainer to the rollout engines: the update descriptor
every sender and receiver takes (update), weight files and their spool (files),
serialization and the vLLM worker extension that loads them (sync), and the collective
transport, a weight group over gloo or NCCL (broadcast).

May import: workers.spec, workers.io.
"""
