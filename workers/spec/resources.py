"""The ``resources`` section (where the run's processes go) and the ``inference`` stage's
workers."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from workers.spec.base import _Strict


class ResourcesSpec(_Strict):
    """Where the run's processes go; workers/cluster/placement.py turns this and the machine into a
    plan (GPUs, memory share and CPU cores per process). The engine count stays
    ``rollout.engines``. ``gpus: N`` alone (older specs) means one node with N GPUs."""
    queue: Literal["cpu", "gpu"] = "cpu"
    gpus: int = Field(0, ge=0, description="GPUs for the run in all (nodes x gpus_per_node); 0 = what the "
                      "worker has")
    nodes: int = Field(1, ge=1, le=1024, description="machines the run spans; trainer ranks split evenly over them")
    gpus_per_node: Optional[int] = Field(None, ge=1, le=64, description="default: gpus / nodes, or all of the "
                                         "worker's")
    trainer_ranks: int = Field(1, ge=1, le=4096, description="trainer processes (DeepSpeed ranks), one GPU each")
    tensor_parallel: int = Field(1, ge=1, le=64, description="shards per rollout engine, each a vLLM worker "
                                 "process: GPUs per engine (one node's), or on a CPU the engine's cores split among "
                                 "them; the number of engines is rollout.engines")
    gpu_memory_utilization: Optional[float] = Field(None, gt=0, le=1, description="share of an engine GPU's "
                                                    "memory vLLM takes; default 0.9, 0.5 with colocate")
    engine_processes: Optional[bool] = Field(None, description="each rollout engine in a server process of its "
                                             "own, started from the plan with its devices, cores and memory share "
                                             "(workers/rollout/server.py). Default: yes (false is refused on GPUs, "
                                             "ignored with nodes > 1); false keeps a CPU run's engines inside the "
                                             "coordinator's process")
    cpu_overlap: Literal["split", "shared"] = Field("split", description="CPU plans whose generation and training "
                                                    "overlap (schedule.mode async, or stream_train): split gives the "
                                                    "engines the first half of each node's cores and the trainer the "
                                                    "rest; shared gives both roles all of them, time-sliced by the "
                                                    "operating system, so a role that waits leaves its cores to the "
                                                    "other (processes it starts wait passively: OMP_WAIT_POLICY)")
    trainer_process: bool = Field(False, description="the trainer in a process of its own even with one rank "
                                  "(always so with trainer_ranks > 1): it then shares no interpreter lock with "
                                  "the coordinator's event loop")
    colocate: bool = Field(False, description="engines share the trainer's GPUs (GPUs only), in a share of their "
                           "memory (gpu_memory_utilization, default 0.5): with schedule.mode sync they sleep through "
                           "each trainer step (vLLM sleep mode) and wake for the update; with async (or stream_train) "
                           "they generate beside the trainer's steps and take in-flight updates")
    inference_gpu: Literal["trainer", "engine", "own"] = Field(
        "trainer", description="GPU plans: where the inference stage's workers (reward.model, algorithm.kl_reference "
        "'stage', critic.forward 'stage') compute, all on node 0: 'trainer' shares trainer rank 0's GPU, 'engine' "
        "the first engine's (in what its vLLM share leaves), 'own' takes the next GPU after the trainer's and the "
        "engines'. The planner counts their weights and forwards there; CPU plans ignore it")

    @field_validator("nodes")
    @classmethod
    def _gpus_split_over_nodes(cls, nodes: int, info) -> int:
        from pydantic_core import PydanticCustomError

        gpus = info.data.get("gpus")
        if gpus and gpus % nodes:
            raise PydanticCustomError("resources_nodes", "resources.gpus ({gpus}) do not split evenly over {nodes} "
                                      "nodes", {"gpus": gpus, "nodes": nodes})
        return nodes

    @field_validator("gpus_per_node")
    @classmethod
    def _gpus_agree(cls, per_node: Optional[int], info) -> Optional[int]:
        from pydantic_core import PydanticCustomError

        gpus, nodes = info.data.get("gpus"), info.data.get("nodes")
        if per_node is not None and gpus and nodes and gpus != nodes * per_node:
            raise PydanticCustomError("resources_gpus", "resources.gpus is {gpus} but nodes x gpus_per_node is "
                                      "{nodes} x {per_node} = {total}: give one of them, or make them agree",
                                      {"gpus": gpus, "nodes": nodes, "per_node": per_node, "total": nodes * per_node})
        return per_node


def shares_cores(spec) -> bool:
    """A CPU run whose overlapped roles (async, or stream_train) share every core
    (resources.cpu_overlap shared): its processes wait passively (OMP_WAIT_POLICY), set before
    OpenMP starts in each (the CLI for the coordinator, the plan and the rank launcher for the
    processes they start)."""
    overlapped = spec.schedule.mode == "async" or spec.schedule.stream_train
    return spec.resources.cpu_overlap == "shared" and overlapped


PASSIVE_WAITS = {"OMP_WAIT_POLICY": "PASSIVE"}


class InferenceSpec(_Strict):
    """The inference stage's workers (algorithm.kl_reference: stage, critic.forward: stage): processes of their own
    beside the coordinator, fed the samples that finish generating close together."""
    micro_batch: int = Field(32, ge=1, le=4096, description="samples per forward at most")
    max_wait_ms: float = Field(20.0, ge=0, le=10_000, description="how long a partial micro-batch waits for more")
    timeout_s: float = Field(120.0, gt=0, le=3600, description="a forward slower than this fails the run")
    threads: int = Field(1, ge=1, le=256, description="CPU threads of each stage worker")
    micro_batch_tokens: int = Field(4096, ge=16, le=1 << 22, description="padded tokens per forward at most: a "
                                    "micro-batch longer than this is split into forwards that fit, so the KL "
                                    "reference's full-vocabulary logits stay within what the planner counts")
