"""The ``rollout`` section: the engines that generate and how they take weight updates."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field

from workers.spec.base import MAX_TOKENS, _Strict


class RolloutSpec(_Strict):
    engines: int = Field(1, ge=1, le=4096, description="rollout engines (each tensor_parallel GPUs on GPUs)")
    max_tokens: int = Field(64, ge=1, le=MAX_TOKENS, description="tokens generated per completion at most: at "
                            "most 262,144, and below max_model_len (the model's context), checked when the run plans")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 = all tokens")
    stop: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(default_factory=list, max_length=16, description="stop strings (kept in the "
                            "completion, so the text scored is exactly the tokens trained on)")
    max_model_len: Optional[int] = Field(None, ge=16, description="prompt + completion tokens; default: the "
                                         "model's own limit. Longer prompts are skipped and counted")
    # keep: pause with KV cache, load, resume (PipelineRL in-flight update)
    # interrupt: abort, load, resubmit prompt+prefix (AReaL)
    # drain: let running requests finish before loading (update between requests)
    update_mode: Literal["keep", "interrupt", "drain"] = "keep"
    max_num_seqs: int = Field(256, ge=1)
    # score each sample the moment it finishes, overlapped with generation (RLHFuse's
    # inter-stage fusion); off = score the whole batch after generation, at a barrier
    fused_scoring: bool = True
    migrate_tail: int = Field(0, ge=0, description="sync mode with 2+ engines: once this few requests remain, "
                              "move some from the busiest engine to the idlest (RLHFuse); 0 = off")
    gather_tail: int = Field(0, ge=0, description="sync mode with 2+ engines: once this few requests remain in "
                             "all, move them onto the engine running the most, so the other engines' cores are free "
                             "for the inference stage (scoring, reward model, reference, critic) while the tail "
                             "finishes (RLHFuse's inter-stage fusion); 0 = off. Not with migrate_tail")
    kv_cache_gb: float = Field(1.0, gt=0)
    rpc_timeout_s: float = Field(60.0, gt=0, description="a weight update an engine has not acknowledged after this "
                                 "long fails the run (a wedged engine) instead of hanging it")
    # rpc: the state dict as safetensors bytes through each engine's RPC; collective: a
    # torch.distributed broadcast from the trainer to every engine (gloo on CPU, NCCL
    # between GPUs; workers/weights/broadcast.py)
    weight_transport: Literal["collective", "rpc"] = "rpc"
    cpu_single_process: Optional[bool] = Field(None, description="vLLM on a CPU: run the model in the engine's own "
                                               "process, with no engine core or worker process (they spin-wait on "
                                               "each other). Default: on for engine servers (resources."
                                               "engine_processes, the default: 1.12x faster async runs on 2 cores), "
                                               "off for an engine inside the coordinator (it would share the "
                                               "trainer's interpreter lock) and for tensor_parallel > 1")
    enforce_eager: Optional[bool] = Field(None, description="vLLM without CUDA graphs or torch.compile. Default: "
                                          "eager on the CPU (compiling there costs minutes at start-up), CUDA graphs "
                                          "on GPUs (faster decoding; memory for the graphs and seconds to capture "
                                          "them at start-up); true: eager everywhere, false: compiled on the CPU too")
    group_requests: bool = Field(True, description="send a prompt group to its engine as one request of group_size "
                                 "samples (vLLM parallel sampling); off = one request per sample. Interrupt updates "
                                 "and migrate_tail or gather_tail always use one request per sample")
    share_engines: bool = Field(False, description="model.lora runs: join this node's shared engine pools instead "
                                "of starting engines of its own. Runs of any team on the same base model and "
                                "engine settings share one vLLM engine per rollout engine, each run's adapter in a "
                                "slot of its own, generation shared fairly by team weight "
                                "(docs/guides/shared-engines.md)")
