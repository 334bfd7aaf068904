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
    # model.dtype auto: bfloat16 on GPUs; 4,096 tokens x 151,936 x 14 bytes of logits dominate the 0.49 B model
    assert "  GPU 0 of node 0: 21.8 of 80.0 GiB (trainer rank 0 CUDA context and runtime buffers (measured) 1.4, " \
           "weights 1.8, gradients 1.8, Adam states 3.7, a micro-batch's forward (activations 4.0, full-vocabulary " \
           "logits 8.1, autocast's weight copies 0.9) 13.0)" in out
    assert "  an engine's share per GPU: 72.0 GiB" in out


def test_a_plan_that_does_not_fit_exits_2_naming_the_logits_and_the_ways_to_lower_them(tmp_path):
    done = plan(tmp_path, "--gpus", "2", "--gpu-memory-gib", "16", "--cpu-cores", "8")
    assert done.returncode == 2
    assert "does not fit: resources: GPU 0 of node 0 needs" in done.stderr
    assert "lower trainer.micro_batch_tokens (now 4096) or set trainer.gradient_checkpointing" in done.stderr
    # smaller micro-batches with checkpointing fit the same GPUs
    assert plan(tmp_path, "--gpus", "2", "--gpu-memory-gib", "16", "--cpu-cores", "8",
                trainer={"micro_batch_tokens": 1024, "gradient_checkpointing": True}).returncode == 0
