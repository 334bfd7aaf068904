"""Bytes that cross a boundary: the run's mutual-TLS wire between processes and nodes
(wire), torch.distributed store masters bound to the plan's address (stores), checkpoint
folders on disk (checkpoint), a stage worker process of this node over a private
socketpair, fed in micro-batches (local_worker), and the platform's REST API (client,
report, heartbeat).

Lowest layer: imports nothing else from workers.
"""
