"""A causal LM trained by `run_clm.py` generates correctly out of the box: its saved config and generation config
name the end-of-text token as EOS, its tokenizer adds no special tokens around a prompt, and `generate()` and
`pipeline("text-generation")` stop at the end of a text.

The corpus is four short documents repeated in random order, each line a document that `run_clm.py` ends with the
end-of-text token: a tiny model learns in a few seconds to finish any document and then emit that token, so the
stopping is the model's own prediction, not a forced logit.
"""

import json
import random

import pytest
import run_clm
import torch
import train_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline


DOCUMENTS = ["one two three four five", "red green blue", "north south east west", "spring summer autumn winter"]
PROMPTS = {
    "one two three": "four five",
    "red green": "blue",
    "north south": "east west",
    "spring": "summer autumn winter",
}
TINY_CAUSAL = (
    "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,head_dim=16,window_size=8,min_window_size=2,"
    "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"
)
MAX_NEW_TOKENS = 20


@pytest.fixture(scope="module", params=[("wordpiece", 120), ("bpe", 320)], ids=["wordpiece", "bpe"])
def trained_folder(request, tmp_path_factory):
    """A causal RAN trained by `run_clm.py` (60 steps, about 2 s) with a tokenizer from `train_tokenizer.py`."""
    model_kind, vocab_size = request.param
    folder = tmp_path_factory.mktemp(f"clm-{model_kind}")
    rng = random.Random(0)
    corpus = folder / "train.txt"
    corpus.write_text("\n".join(rng.choice(DOCUMENTS) for _ in range(400)) + "\n")
    train_tokenizer.main(
        ["--train_files", str(corpus), "--model", model_kind, "--vocab_size", str(vocab_size)]
        + ["--min_frequency", "1", "--output_dir", str(folder / "tokenizer")]
    )
    output_dir = folder / "clm"
    run_clm.main(
        ["--tokenizer_name", str(folder / "tokenizer"), "--config_overrides", TINY_CAUSAL]
        + ["--train_file", str(corpus), "--validation_split_percentage", "0", "--output_dir", str(output_dir)]
        + ["--block_size", "64", "--do_train", "--max_steps", "60", "--per_device_train_batch_size", "8"]
        + ["--learning_rate", "1e-2", "--seed", "0"]
        + ["--report_to", "none", "--disable_tqdm", "true", "--log_level", "warning"]
    )
    return output_dir


def test_config_and_generation_config_name_the_end_of_text_token(trained_folder):
    tokenizer = AutoTokenizer.from_pretrained(trained_folder)
    sep_id = tokenizer.convert_tokens_to_ids("[SEP]")  # what run_clm.py ends documents with (no EOS was defined)
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((trained_folder / name).read_text())
        assert saved["eos_token_id"] == sep_id, name
        assert saved["pad_token_id"] == tokenizer.pad_token_id == 0, name
    assert tokenizer.eos_token == "[SEP]"


def test_the_saved_tokenizer_does_not_wrap_a_prompt(trained_folder):
    tokenizer = AutoTokenizer.from_pretrained(trained_folder)
    bare = tokenizer("red green", add_special_tokens=False)["input_ids"]
    assert tokenizer("red green")["input_ids"] == bare
    assert tokenizer.cls_token_id not in bare and tokenizer.sep_token_id not in bare
    # A pair is joined as training joins documents: by the end-of-text token.
    pair = tokenizer("red green", "blue")["input_ids"]
    assert pair == bare + [tokenizer.eos_token_id] + tokenizer("blue", add_special_tokens=False)["input_ids"]


def test_generate_as_the_readme_calls_it_stops_at_the_end_of_text(trained_folder):
    """`model.generate(**tokenizer([...], return_tensors="pt"))`, left-padded batch included: every row finishes its
    document, emits the end-of-text token and is padded after it, well before `max_new_tokens`."""
    tokenizer = AutoTokenizer.from_pretrained(trained_folder)
    model = AutoModelForCausalLM.from_pretrained(trained_folder).eval()
    prompts = list(PROMPTS)
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    new_tokens = generated[:, inputs["input_ids"].shape[1] :]
    assert new_tokens.shape[1] < MAX_NEW_TOKENS  # every row stopped
    for prompt, row in zip(prompts, new_tokens.tolist()):
        end = row.index(tokenizer.eos_token_id)
        assert set(row[end + 1 :]) <= {tokenizer.pad_token_id}
        assert tokenizer.decode(row[:end]).strip() == PROMPTS[prompt]


def test_the_text_generation_pipeline_on_the_folder_stops_at_the_end_of_text(trained_folder):
    generator = pipeline("text-generation", model=str(trained_folder))
    for prompt, continuation in PROMPTS.items():
        (result,) = generator(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_tensors=True)
        ids = result["generated_token_ids"]
        prompt_length = len(generator.tokenizer(prompt)["input_ids"])
        assert ids[-1] == generator.tokenizer.eos_token_id
        assert len(ids) - prompt_length < MAX_NEW_TOKENS
        (result,) = generator(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_full_text=False)
        assert result["generated_text"].strip() == continuation
