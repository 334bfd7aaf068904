"""FluxRL's RL engine. Runs on the GPU (or CPU) machines; imports no Django.

It talks to the platform only through its REST API (workers.io.client, workers.io.report).
"""
