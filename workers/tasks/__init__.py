"""What a task is: its rows (datasets: JSONL files and built-in generators), how a row
becomes the model's input (prompts: templates, chat formats, tokenizers) and the built-in
rewards that check an answer (builtin_rewards: pure functions, no user code).

Lowest layer: imports nothing else from workers.
"""
