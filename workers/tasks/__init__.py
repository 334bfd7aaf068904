"""What a task is: its rows (datasets: JSONL files and built-in generators), how a row
becomes the model's input (prompts: templates, chat formats, tokenizers), the built-in
rewards that check an answer (builtin_rewards: pure functions, no user code) and the check
run before any model folder is loaded, that it reads only its own files (model_folder).

Lowest layer: imports nothing else from workers.
"""
