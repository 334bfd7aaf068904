"""Where a run's processes go and how other nodes join: the placement plan (placement)
and the node agent that starts engine servers and trainer ranks on another machine (node).

May import everything below it: workers.rollout, workers.train and their layers.
"""
