"""The models FluxRL builds and checks itself: the tiny model (tinymodel), the small
Qwen2/Llama/GPT-2 zoo (modelzoo), the tiny reward model (reward_model), the preflight
that checks any Hugging Face model before a run (preflight) and held-out accuracy by
plain HF generation (hf_eval).

May import: workers.rewards, workers.weights, workers.spec, workers.tasks, workers.io.
"""
