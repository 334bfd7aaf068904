"""bench/external_model.py: the model folder built apart from the zoo's code for
bench/defaults.py: its 64-id character tokenizer and chat template, and a folder
that FluxRL's own loader takes as any user's."""
from bench.external_model import build_model, build_tokenizer, encode

ROW = {"messages": [{"role": "system", "content": "You are a careful calculator. Answer with the whole equation."},
                    {"role": "user", "content": "What is 23 + 45?"}], "answer": "68"}


def test_the_tokenizer_has_64_ids_one_a_character_and_knows_every_character_of_the_task():
    tok = build_tokenizer()
    assert len(tok) == 64
    prompt, answer = encode(tok, ROW)
    assert tok.unk_token_id not in prompt + answer
    assert answer == [tok.convert_tokens_to_ids("6"), tok.convert_tokens_to_ids("8"), tok.eos_token_id]
    assert tok.decode(prompt) == ("<|im_start|>system\nYou are a careful calculator. Answer with the whole "
                                  "equation.<|im_end|>\n<|im_start|>user\nWhat is 23 + 45?<|im_end|>\n"
                                  "<|im_start|>assistant\n")


def test_a_saved_folder_renders_prompts_and_stops_through_fluxrls_own_path(tmp_path):
    import transformers

    from workers.tasks.model_folder import check_model_folder
    from workers.tasks.prompts import PromptRenderer, load_tokenizer, stop_token_ids

    tok = build_tokenizer()
    model = build_model(tok, seed=0)
    assert model.config.vocab_size == 64 and model.config.tie_word_embeddings
    model.generation_config = transformers.GenerationConfig(eos_token_id=tok.eos_token_id,
                                                            pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    check_model_folder(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    assert PromptRenderer(loaded).ids(ROW) == encode(tok, ROW)[0]  # the folder's own chat template
    assert stop_token_ids(str(tmp_path), loaded) == [tok.eos_token_id]
