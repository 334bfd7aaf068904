"""``python -m workers plan SPEC``: the placement and, on GPUs, what each GPU would hold, for
a machine the user describes, before anything starts; a plan that does not fit exits 2
naming the GPU and the largest item. Qwen2.5-0.5B's exact shape (a config only: sized on
the meta device, no weights) on one GPU."""
import json
import subprocess
import sys

import yaml

QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
              "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "tie_word_embeddings": True, "max_position_embeddings": 32768}


def plan(tmp_path, *args, trainer=None):
    model = tmp_path / "qwen2.5-0.5b-shape"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN25_05B))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "plan", "model": {"path": str(model)}, "task": {"dataset": "gen:add"},
        "schedule": {"mode": "async"}, "resources": {"queue": "gpu", "gpus": 2}, "trainer": trainer or {}}))
    return subprocess.run([sys.executable, "-m", "workers", "plan", str(spec), *args], capture_output=True,
                          text=True, timeout=120)


def test_the_plan_of_a_real_shaped_model_lists_each_gpu_with_its_logits_and_fits_on_80_gib(tmp_path):
    done = plan(tmp_path, "--gpus", "2", "--gpu-memory-gib", "80", "--cpu-cores", "8")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("gpu plan: 1 node(s) x 2 GPUs, disaggregated")
    # model.dtype auto: bfloat16 on GPUs (autocast at ZeRO 0); 4,096 tokens x 151,936 x 24 bytes of logits (the
    # entropy's and the backward's fp32 copies) dominate the 0.49 B model
    assert "  GPU 0 of node 0: 30.2 of 80.0 GiB (trainer rank 0 CUDA context and runtime buffers (measured) 1.4, " \
           "weights 1.8, gradients 1.8, Adam states 3.7, a micro-batch's forward of 4096 tokens (activations 6.6, " \
           "full-vocabulary logits 13.9, autocast's weight copies 0.9) 21.4)" in out
    assert "  an engine's share per GPU: 72.0 GiB" in out


def test_a_plan_that_does_not_fit_exits_2_naming_the_logits_and_the_ways_to_lower_them(tmp_path):
    done = plan(tmp_path, "--gpus", "2", "--gpu-memory-gib", "16", "--cpu-cores", "8")
    assert done.returncode == 2
    assert "does not fit: resources: GPU 0 of node 0 needs" in done.stderr
    assert "lower trainer.micro_batch_tokens (now 4096) or set trainer.gradient_checkpointing" in done.stderr
    # smaller micro-batches with checkpointing fit the same GPUs
    assert plan(tmp_path, "--gpus", "2", "--gpu-memory-gib", "16", "--cpu-cores", "8",
                trainer={"micro_batch_tokens": 1024, "gradient_checkpointing": True}).returncode == 0


QWEN25_72B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8192,
              "num_hidden_layers": 80, "intermediate_size": 29568, "num_attention_heads": 64, "num_key_value_heads": 8,
              "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6}


def test_qwen25_72b_at_zero3_over_128_ranks_on_32_nodes_of_141_gib_places_by_role(tmp_path):
    # docs/deployment.md, "A worked example: Qwen2.5-72B": the trainer's 16 nodes, the engines' 16; ZeRO-3's
    # gather is one module (the 152,064 x 8,192 LM head), not the model
    from workers.cluster.model_size import model_size
    from workers.cluster.placement import Machine, plan_placement
    from workers.spec import validate_spec

    model = tmp_path / "qwen2.5-72b-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_72B))
    size = model_size(str(model))
    assert (round(size.params / 1e9, 1), size.largest_module) == (72.7, 152064 * 8192)
    machine = Machine(cpu_cores=64, gpus_per_node=8, gpu_memory_gib=141)
    for tp, engines in ((4, 32), (8, 16)):
        run = validate_spec({
            "name": "q72", "model": {"path": str(model), "dtype": "bfloat16"}, "task": {"dataset": "gen:add"},
            "schedule": {"mode": "async"}, "rollout": {"engines": engines, "max_tokens": 3072, "max_model_len": 4096},
            "trainer": {"zero_stage": 3, "gradient_checkpointing": True},
            "resources": {"queue": "gpu", "nodes": 32, "gpus_per_node": 8, "trainer_ranks": 128,
                          "tensor_parallel": tp}})
        plan = plan_placement(run, machine, size)
        assert plan.node_roles() == ["  nodes 0-15: trainer ranks 0-127 (8 a node)",
                                     f"  nodes 16-31: engines 0-{engines - 1} ({8 // tp} a node)"]
        rank = plan.memory.gpus[0]
        assert (rank.node, rank.gpu, round(rank.total_gib, 1)) == (0, 0, 33.0)
        assert round(plan.memory.trainer.gather_gib, 2) == 2.32
        assert round(plan.memory.engine_weights_gib, 1) == {4: 33.9, 8: 16.9}[tp]
    # the CLI shows the same layout
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({
        "name": "q72", "model": {"path": str(model), "dtype": "bfloat16"}, "task": {"dataset": "gen:add"},
        "schedule": {"mode": "async"}, "rollout": {"engines": 16, "max_tokens": 3072, "max_model_len": 4096},
        "trainer": {"zero_stage": 3, "gradient_checkpointing": True},
        "resources": {"queue": "gpu", "nodes": 32, "gpus_per_node": 8, "trainer_ranks": 128, "tensor_parallel": 8}}))
    done = subprocess.run([sys.executable, "-m", "workers", "plan", str(spec_file), "--gpus", "8", "--gpu-memory-gib",
                           "141", "--cpu-cores", "64"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "  nodes 0-15: trainer ranks 0-127 (8 a node)\n  nodes 16-31: engines 0-15 (1 a node)\n" in done.stdout
