"""Causal RAN: strictly causal, really recurrent, and a recurrent cache whose decoding equals the full forward."""

import copy
import random

import pytest
import torch
from ran_testing import randomize_, tiny_config
from transformers import pipeline

from ran_hf import RANCache, RANForCausalLM


TOLERANCE = 1e-5


def causal_model(seed=0, **overrides):
    return randomize_(RANForCausalLM(tiny_config(is_causal=True, **overrides)), seed=seed)


def random_causal_case(seed):
    rng = random.Random(seed)
    window = rng.choice([3, 4, 5, 8])
    overrides = {
        "num_hidden_layers": rng.choice([1, 2, 3]),
        "window_size": window,
        "min_window_size": rng.randint(1, window - 1),
        "window_overlap": rng.choice([0, rng.randint(1, window - 1)]),
        "memory_review": rng.random() < 0.8,
        "review_initial_cell": rng.random() < 0.3,
        "review_qk_norm": rng.random() < 0.7,
    }
    return overrides, rng.randint(window + 1, 4 * window + 3)


@pytest.mark.parametrize("reads_initial_cell", [False, True])
def test_first_window_reads_a_cell_only_with_review_initial_cell(reads_initial_cell):
    """Memory review's keys and values come from cells; without the initial cell the first window reads none, so its
    outputs do not depend on them, while later windows do."""
    model = causal_model(review_initial_cell=reads_initial_cell)
    window = model.config.window_size
    ids = torch.randint(1, model.config.vocab_size, (2, 3 * window), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        for layer in model.model.layers:
            layer.memory_review.kv_proj.weight.mul_(3.0)
            layer.memory_review.kv_proj.bias.add_(0.5)
        after = model(ids).logits
    first_window_changed = not torch.allclose(before[:, :window], after[:, :window], atol=TOLERANCE)
    assert first_window_changed == reads_initial_cell
    assert not torch.allclose(before[:, window:], after[:, window:], atol=TOLERANCE)


@pytest.mark.parametrize("seed", range(8))
def test_changing_a_token_never_changes_earlier_logits(seed):
    overrides, length = random_causal_case(seed)
    model = causal_model(seed, **overrides)
    ids = torch.randint(1, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        reference = model(ids).logits
        for position in range(length):
            changed = ids.clone()
            changed[0, position] = 1 + (changed[0, position] % (model.config.vocab_size - 1))
            logits = model(changed).logits
            assert torch.equal(logits[:, :position], reference[:, :position]), f"token {position} leaked backwards"
            assert not torch.equal(logits[:, position:], reference[:, position:])


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_first_window_reaches_the_last_window_in_every_layer(num_layers):
    """The cell carries the past: unlike the official causal mode (exactly 0.0), the first window matters later."""
    model = causal_model(1, num_hidden_layers=num_layers, window_size=4, min_window_size=2)
    ids = torch.randint(1, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    changed = ids.clone()
    changed[0, :4] = (changed[0, :4] % (model.config.vocab_size - 1)) + 1
    with torch.no_grad():
        before = model(ids, output_hidden_states=True)
        after = model(changed, output_hidden_states=True)
    last_window = slice(16, 20)
    for layer in range(1, num_layers + 1):
        change = (before.hidden_states[layer][:, last_window] - after.hidden_states[layer][:, last_window]).abs()
        assert change.max() > 1e-2, f"layer {layer}: last window untouched by the first ({change.max():.1e})"
    assert (before.logits[:, last_window] - after.logits[:, last_window]).abs().max() > 1e-2


def decode_in_chunks(model, ids, chunk_sizes, attention_mask=None):
    """Feed `ids` chunk by chunk through a cache; returns the concatenated logits and the final cache."""
    cache, logits, start = None, [], 0
    for size in chunk_sizes:
        chunk = ids[:, start : start + size]
        mask = None if attention_mask is None else attention_mask[:, : start + size]
        outputs = model(chunk, attention_mask=mask, past_key_values=cache, use_cache=True)
        cache, start = outputs.past_key_values, start + size
        logits.append(outputs.logits)
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="plain"),
        pytest.param({"window_overlap": 2}, id="overlap"),
        pytest.param({"num_hidden_layers": 3, "window_size": 3, "min_window_size": 1}, id="three-layers-window-3"),
        pytest.param({"memory_review": False, "window_overlap": 1}, id="no-memory-review"),
        pytest.param({"review_initial_cell": False}, id="no-initial-cell"),
        pytest.param(
            {"residual_stream": False, "review_qk_norm": False, "review_salience": False}, id="official-layer"
        ),
        pytest.param({"memory_review_cells": 2, "window_overlap": 1}, id="bounded-memory"),
        pytest.param({"memory_review_cells": 1, "review_initial_cell": False}, id="bounded-memory-no-initial-cell"),
        pytest.param({"memory_review_cells": 1, "memory_salient_cells": 2, "window_overlap": 1}, id="salient-cells"),
        pytest.param(
            {"memory_review_cells": 2, "memory_salient_cells": 1, "review_initial_cell": False},
            id="salient-cells-no-initial-cell",
        ),
    ],
)
def test_token_by_token_and_chunked_decoding_equal_the_full_forward(overrides):
    model = causal_model(2, **overrides)
    ids = torch.randint(1, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        stepwise, _ = decode_in_chunks(model, ids, [1] * 23)
        chunked, _ = decode_in_chunks(model, ids, [3, 8, 1, 6, 5])
    assert (stepwise - full).abs().max() <= TOLERANCE
    assert (chunked - full).abs().max() <= TOLERANCE


@pytest.mark.parametrize(
    "overrides",
    [{}, {"memory_review_cells": 2}, {"memory_review_cells": 1, "memory_salient_cells": 2}],
    ids=["all-cells", "bounded-memory", "salient-cells"],
)
def test_cached_decoding_of_a_left_padded_batch_equals_each_sequence_alone(overrides):
    model = causal_model(3, window_overlap=1, **overrides)
    lengths, total = [17, 9, 13], 17
    ids = torch.zeros(3, total, dtype=torch.long)
    mask = torch.zeros(3, total, dtype=torch.long)
    sequences = [torch.randint(1, model.config.vocab_size, (n,)) for n in lengths]
    for row, sequence in enumerate(sequences):
        ids[row, total - len(sequence) :], mask[row, total - len(sequence) :] = sequence, 1
    with torch.no_grad():
        batched, _ = decode_in_chunks(model, ids, [6, 1, 1, 9], attention_mask=mask)
        for row, sequence in enumerate(sequences):
            alone = model(sequence[None]).logits[0]
            assert (batched[row, total - len(sequence) :] - alone).abs().max() <= TOLERANCE


@pytest.mark.parametrize("overrides", [{}, {"window_overlap": 1}, {"memory_review_cells": 2}])
def test_padding_inside_a_continued_chunk_is_skipped(overrides):
    """A row whose continuation (read against the cache, with the mask of the whole text) begins with padding after
    real tokens: its last logits are those of the full forward, and of the row without the padding."""
    model = causal_model(7, **overrides)
    ids = torch.randint(1, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, 9:14] = 0  # row 1: 9 tokens, then 5 padding positions in the chunk that continues them
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits[:, -1]
        first = model(ids[:, :9], attention_mask=mask[:, :9], use_cache=True)
        continued = model(ids[:, 9:], attention_mask=mask, past_key_values=first.past_key_values).logits[:, -1]
        without_padding = model(ids[1:, mask[1].bool()]).logits[0, -1]
    assert (continued - full).abs().max() <= TOLERANCE
    assert (continued[1] - without_padding).abs().max() <= TOLERANCE


@pytest.mark.parametrize("generate_kwargs", [{"do_sample": False}, {"do_sample": False, "num_beams": 3}])
def test_generate_with_cache_matches_generate_without(generate_kwargs):
    model = causal_model(4, window_overlap=1)
    ids = torch.randint(2, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding
    common = dict(attention_mask=mask, max_new_tokens=14, pad_token_id=0, **generate_kwargs)
    with_cache = model.generate(ids, **common)
    without_cache = model.generate(ids, use_cache=False, **common)
    assert torch.equal(with_cache, without_cache)
    alone = model.generate(ids[1:, 3:], max_new_tokens=14, pad_token_id=0, **generate_kwargs)
    assert torch.equal(alone[0], with_cache[1, 3:]), "left padding changed what a prompt generates"


def test_generate_sampling_embeddings_and_continuation():
    model = causal_model(5)
    ids = torch.randint(2, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(7))
    sampled = model.generate(ids, do_sample=True, num_return_sequences=3, max_new_tokens=5, pad_token_id=0)
    assert sampled.shape == (3, 11) and torch.equal(sampled[:, :6], ids.expand(3, -1))

    embeds = model.get_input_embeddings()(ids)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=6, do_sample=False, pad_token_id=0)
    from_ids = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(from_embeds, from_ids[:, 6:])

    first = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert isinstance(first.past_key_values, RANCache)
    continued = model.generate(
        first.sequences, past_key_values=first.past_key_values, max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    assert torch.equal(continued, model.generate(ids, max_new_tokens=9, do_sample=False, pad_token_id=0))

    # Continued from embeddings too: those of the whole text so far, with the cache of the call that read the prompt's.
    greedy = {"do_sample": False, "pad_token_id": 0}
    first = model.generate(inputs_embeds=embeds, max_new_tokens=4, return_dict_in_generate=True, **greedy)
    text = torch.cat([embeds, model.get_input_embeddings()(first.sequences)], dim=1)
    continued = model.generate(inputs_embeds=text, past_key_values=first.past_key_values, max_new_tokens=5, **greedy)
    expected = model.generate(ids, max_new_tokens=9, **greedy)[:, 6:]
    assert torch.equal(torch.cat([first.sequences, continued], dim=1), expected)


def test_cache_memory_grows_only_by_one_cell_per_window():
    """After 512 and 16,384 tokens the caches differ exactly by the cells of the windows in between."""
    model = causal_model(6, window_size=64, min_window_size=8, window_overlap=4, hidden_size=16)
    config = model.config
    ids = torch.randint(1, config.vocab_size, (1, 16384), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _, short = decode_in_chunks(model, ids[:, :512], [500, 12])
        _, long = decode_in_chunks(model, ids, [16000, 384])
    cell_bytes = 2 * config.hidden_size * 4 * config.num_hidden_layers  # a key and a value per cell and layer
    extra_windows = 16384 // 64 - 512 // 64
    assert long.nbytes() - short.nbytes() == extra_windows * cell_bytes
    for layer in long.layers:  # the longest tail (a window but one, and its enrichment), and a decoding step's slot
        assert layer.tail_keys.shape[1] == config.window_size + config.window_overlap


def test_a_bounded_memory_keeps_the_cache_flat_and_reads_only_recent_cells():
    """With `memory_review_cells`, a cache after 16K tokens is as large as after 512, and a token reviews exactly
    the starting cell and the cells of the last M windows before its own."""
    model = causal_model(6, window_size=64, min_window_size=8, window_overlap=4, hidden_size=16, memory_review_cells=4)
    ids = torch.randint(1, model.config.vocab_size, (1, 16384), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _, short = decode_in_chunks(model, ids[:, :512], [500, 12])
        _, long = decode_in_chunks(model, ids, [16000, 384])
        weights = model(ids[:, :640], output_attentions=True).memory_attentions
    assert long.nbytes() == short.nbytes()
    for layer_weights in weights:  # (B, L, 1 + C): the starting cell, then window 0's cell, ...
        for position, window in [(10, 0), (70, 1), (300, 4), (639, 9)]:
            read = (layer_weights[0, position] > 0).nonzero().flatten().tolist()
            assert read == [0] + [1 + cell for cell in range(max(0, window - 4), window)], (position, read)
    # A bound that reaches every earlier window of the text changes nothing.
    with torch.no_grad():
        model.config.memory_review_cells = 10  # 640 tokens: windows 0-9
        bounded = model(ids[:, :640]).logits
        model.config.memory_review_cells = None
        assert torch.equal(model(ids[:, :640]).logits, bounded)


def review_cell_states(model, ids):
    """Per layer, the (B, 1 + C, 2 D) cells its memory review reads in one forward pass over `ids`."""
    captured = []
    reviews = [layer.memory_review for layer in model.model.layers]
    for review in reviews:  # the cells the review of the tokens reads, past the review's own bookkeeping

        def review_tokens(token_states, cell_states, *args, plain=review.review_tokens):
            captured.append(cell_states)
            return plain(token_states, cell_states, *args)

        review.review_tokens = review_tokens
    try:
        outputs = model(ids, output_attentions=True)
    finally:
        for review in reviews:
            del review.review_tokens
    return outputs, captured


def test_salient_cells_keep_the_cache_flat_and_a_token_reads_the_most_salient_older_cells():
    """With `memory_salient_cells=S`, a cache after 16K tokens is as large as after 512, and a token in window w
    reviews exactly the starting cell, the last M windows' cells and the S most salient cells of windows before
    w - M, by the learned prior each memory review gives a cell."""
    model = causal_model(6, window_size=64, min_window_size=8, hidden_size=16, memory_review_cells=3)
    model.config.memory_salient_cells = 2  # settable on a trained model
    ids = torch.randint(1, model.config.vocab_size, (1, 16384), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _, short = decode_in_chunks(model, ids[:, :512], [500, 12])
        _, long = decode_in_chunks(model, ids, [16000, 384])
        outputs, cells = review_cell_states(model, ids[:, :640])
    assert long.nbytes() == short.nbytes()
    assert all(layer.salient_windows.tolist() != [[-1, -1]] for layer in long.layers)
    for layer, layer_cells, layer_weights in zip(model.model.layers, cells, outputs.memory_attentions):
        salience = layer.memory_review.cell_salience(layer_cells[0, 1:]).tolist()  # window c's cell is 1 + c
        assert len(set(salience)) == len(salience)  # no ties: the expected set below is unambiguous
        for position, window in [(10, 0), (200, 3), (300, 4), (639, 9)]:
            older = sorted(range(max(0, window - 3)), key=lambda cell: -salience[cell])[:2]
            expected = [0] + sorted(1 + cell for cell in older + list(range(max(0, window - 3), window)))
            read = (layer_weights[0, position] > 0).nonzero().flatten().tolist()
            assert read == expected, (position, read, expected)


def test_salient_cells_are_chosen_alike_from_any_order_of_candidates():
    """The choice is a total order (salience, then the older window), so a cache that holds only the past's salient
    cells, in whatever order, chooses what the full forward does; empty slots (window -1) are never chosen."""
    from ran_hf.causal_memory import salient_cells

    generator = torch.Generator().manual_seed(0)
    salience = torch.randint(0, 4, (2, 12), generator=generator).float()  # many ties
    windows = torch.arange(12).expand(2, -1).clone()
    windows[1, 3] = -1
    reading = torch.tensor([[5, 9, 13], [6, 10, 14]])
    chosen = salient_cells(salience, windows, reading, recent=2, kept=3)
    for row in range(2):
        for r, window in enumerate(reading[row].tolist()):
            eligible = [c for c in range(12) if 0 <= windows[row, c] < window - 2]
            expected = sorted(eligible, key=lambda c: (-salience[row, c].item(), windows[row, c].item()))[:3]
            assert chosen[row, r].nonzero().flatten().tolist() == sorted(expected)
    shuffle = torch.randperm(12, generator=generator)
    shuffled = salient_cells(salience[:, shuffle], windows[:, shuffle], reading, recent=2, kept=3)
    assert torch.equal(shuffled, chosen[..., shuffle])


def test_training_and_no_cache_paths_build_no_cache():
    model = causal_model(7).train()
    ids = torch.randint(1, model.config.vocab_size, (2, 11))
    outputs = model(ids, labels=ids)
    assert outputs.past_key_values is None
    outputs.loss.backward()
    assert model.eval()(ids, use_cache=False).past_key_values is None


def test_loss_is_the_shifted_next_token_loss():
    model = causal_model(8)
    ids = torch.randint(1, model.config.vocab_size, (2, 9))
    labels = ids.clone()
    labels[0, 4] = -100
    outputs = model(ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(
        outputs.logits[:, :-1].reshape(-1, model.config.vocab_size), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    assert torch.allclose(outputs.loss, expected, atol=1e-6)
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(1)).loss
    assert torch.allclose(summed, expected * (labels[:, 1:] != -100).sum(), atol=1e-4)


def test_bidirectional_models_refuse_a_cache(make_config):
    from ran_hf import RANModel

    model = RANModel(make_config())
    with pytest.raises(ValueError, match="causal"):
        model(torch.ones(1, 3, dtype=torch.long), use_cache=True)


@pytest.mark.needs_data("wikitext-2", "conll2003")  # the WordPiece tokenizer's corpus
def test_text_generation_pipeline(wordpiece_tokenizer):
    config = tiny_config(is_causal=True, vocab_size=len(wordpiece_tokenizer), pad_token_id=0)
    model = RANForCausalLM(config).eval()
    generator = pipeline("text-generation", model=model, tokenizer=wordpiece_tokenizer)
    prompts = ["the company said on monday", "it was"]
    # Batched, the shorter prompt is left-padded: the pipeline must still continue each as the model alone does.
    texts = generator(prompts, max_new_tokens=6, do_sample=False, batch_size=2)
    tokens = generator(prompts, max_new_tokens=6, do_sample=False, batch_size=2, return_tensors=True)
    assert len(texts) == len(tokens) == 2
    for prompt, text, token in zip(prompts, texts, tokens):
        ids = wordpiece_tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            greedy = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0]
        generated = token[0]["generated_token_ids"]
        padding = len(generated) - len(greedy)  # the batch's left padding ([PAD] = 0)
        assert generated[:padding] == [0] * padding and generated[padding:] == greedy.tolist()
        continuation = wordpiece_tokenizer.decode(greedy[ids.shape[1] :], skip_special_tokens=True)
        assert continuation  # the model's own tokens, not the prompt, are what is compared
        assert text[0]["generated_text"].removeprefix(prompt).strip() == continuation.strip()


# Runs where `ran_hf` cannot be imported: the saved causal model generates through its own remote code.
GENERATE_WITHOUT_RAN_HF = r"""
import torch
from transformers import AutoModelForCausalLM

folder, prompt = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
report["module"] = type(model).__module__
prompt = torch.tensor(prompt)
report["greedy"] = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0).tolist()
report["beam"] = model.generate(prompt, max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0).tolist()
"""


@pytest.mark.slow
def test_saved_causal_model_generates_as_remote_code_without_ran_hf(tmp_path):
    import json

    from remote_code import run_without_ran_hf

    model = causal_model(9, window_overlap=1)
    model.save_pretrained(tmp_path / "saved")
    prompt = torch.randint(2, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(9))
    report = run_without_ran_hf(GENERATE_WITHOUT_RAN_HF, [tmp_path / "saved", json.dumps(prompt.tolist())], tmp_path)
    assert report["module"].startswith("transformers_modules"), report["module"]
    assert report["greedy"] == model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0).tolist()
    beam = model.generate(prompt, max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
    assert report["beam"] == beam.tolist()


def gradients(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_turns_a_new_cache_off_and_keeps_gradients():
    model, ids = causal_model(), torch.randint(1, 61, (2, 17), generator=torch.Generator().manual_seed(3))
    model.train()
    model(ids, labels=ids).loss.backward()
    expected = gradients(model)
    model.zero_grad()
    model.gradient_checkpointing_enable()
    outputs = model(ids, labels=ids, use_cache=True)
    outputs.loss.backward()
    assert outputs.past_key_values is None
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_training_through_a_cache_under_gradient_checkpointing():
    """Chunks carrying a cache train as without checkpointing: layers with a cache are simply not checkpointed."""
    ids = torch.randint(1, 61, (2, 19), generator=torch.Generator().manual_seed(4))
    results = []
    for checkpointing in (False, True):
        model = causal_model()
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        first = model(ids[:, :11], labels=ids[:, :11], use_cache=True, past_key_values=RANCache(model.config))
        second = model(ids[:, 11:], labels=ids[:, 11:], use_cache=True, past_key_values=first.past_key_values)
        (first.loss + second.loss).backward()
        results.append(gradients(model))
    assert results[0].keys() == results[1].keys()
    for name, grad in results[1].items():
        torch.testing.assert_close(grad, results[0][name], rtol=1e-5, atol=1e-6, msg=name)


def test_assisted_generation_is_refused_before_it_starts():
    model = causal_model().eval()
    ids = torch.randint(1, 61, (1, 6), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids, assistant_model=causal_model(seed=1).eval(), max_new_tokens=3, do_sample=False)


def test_generate_refuses_a_cache_that_has_read_more_than_the_text_given():
    """A cache continues the text it read: `generate()` given it with the whole text so far reads what follows, and
    given a text no longer than what the cache read (a shorter prompt, or the same prompt a second time) refuses,
    naming the cache's length, where it used to read the prompt's tokens again after the cache's."""
    model = causal_model(9)
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        longer = model(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="already read 30 positions, but `generate\\(\\)` was given 20"):
            model.generate(ids[:, :20], past_key_values=longer, max_new_tokens=3)
        cache = RANCache(model.config)
        first = model.generate(ids[:, :20], past_key_values=cache, max_new_tokens=3, do_sample=False)
        with pytest.raises(ValueError, match="already read 22 positions"):
            model.generate(ids[:, :20], past_key_values=cache, max_new_tokens=3, do_sample=False)
        continued = model.generate(first, past_key_values=cache, max_new_tokens=3, do_sample=False)
        whole = model.generate(ids[:, :20], max_new_tokens=6, do_sample=False)
    assert torch.equal(continued, whole)


def test_a_cache_written_in_another_dtype_is_refused_naming_both():
    """A bfloat16 model's cache continued by the model cast to float32 failed inside `index_put` with a raw dtype
    error; the cast model checks the caches it is handed again, a decoding step's included."""
    model = causal_model(3).to(torch.bfloat16)
    ids = torch.randint(1, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        model.float()
        for new in (ids[:, :1], ids[:, :3]):  # a decoding step, and a chunk
            with pytest.raises(ValueError, match="written by a model in torch.bfloat16, and this one computes in "):
                model(new, past_key_values=cache, use_cache=True)


def test_a_cache_position_that_disagrees_with_the_cache_is_refused_and_an_agreeing_one_changes_nothing():
    """`cache_position` given with a cache must say where the cache stands (it has read 8 positions: the next token
    is at 8); one that agrees gives the logits of leaving it out, one that does not is refused before anything runs,
    naming both and leaving the cache as it was."""
    model = RANForCausalLM(tiny_config(is_causal=True, window_size=4, min_window_size=2)).eval()
    ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = RANCache(model.config)
    with torch.no_grad():
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        expected = model(ids[:, 8:], past_key_values=copy.deepcopy(cache), use_cache=True).logits
        given = model(ids[:, 8:], past_key_values=copy.deepcopy(cache), cache_position=torch.tensor([8])).logits
        assert torch.equal(given, expected)
        for wrong in (torch.tensor([3]), torch.tensor([8, 9])):
            with pytest.raises(ValueError, match=r"`cache_position` is \[.*has read 8 positions"):
                model(ids[:, 8:], past_key_values=cache, use_cache=True, cache_position=wrong)
        assert cache.get_seq_length() == 8
        with pytest.raises(ValueError, match=r"has read 0 positions"):  # no cache: a text starts at 0
            model(ids[:, :4], cache_position=torch.arange(2, 6))


def test_a_hook_on_the_base_model_sees_every_decoding_step_and_changes_nothing():
    """A decoding step skips the base model's call (and its wrappers) only where no hook would see it: a hook on
    `model.model` (an offloading hook of accelerate, say) is called at every step, with the same logits."""
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True, window_size=4, min_window_size=2))).eval()
    ids = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = RANCache(model.config)
    seen = []
    with torch.no_grad():
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        hooked_cache = copy.deepcopy(cache)
        plain = [model(ids[:, p : p + 1], past_key_values=cache).logits for p in range(6, 12)]
        handle = model.model.register_forward_hook(lambda module, args, output: seen.append(output.past_key_values))
        hooked = [model(ids[:, p : p + 1], past_key_values=hooked_cache).logits for p in range(6, 12)]
        handle.remove()
    assert len(seen) == 6 and all(cache is hooked_cache for cache in seen)
    for expected, logits in zip(plain, hooked):
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_a_cache_handed_to_another_model_keeps_none_of_what_the_first_models_steps_kept():
    """What decoding steps keep between steps (the read cell's key and value, the reviewed cells) is the computing
    model's: a second model continuing the cache (another fine-tune of the same shape) computes them anew, as from a
    cache that never kept them."""
    config = tiny_config(is_causal=True, window_size=4, min_window_size=2)
    first, second = (randomize_(RANForCausalLM(config), seed=seed).eval() for seed in (0, 1))
    ids = torch.randint(1, 61, (2, 8), generator=torch.Generator().manual_seed(0))
    cache = RANCache(config)
    with torch.no_grad():
        first(ids[:, :5], past_key_values=cache, use_cache=True)
        first(ids[:, 5:6], past_key_values=cache)  # a step: the first model's memos are kept
        assert cache.layers[0].step_window is not None
        unkept = copy.deepcopy(cache)
        for layer in unkept.layers:
            layer.step_window = layer.step_review = None
        expected = second(ids[:, 6:7], past_key_values=unkept).logits
        torch.testing.assert_close(second(ids[:, 6:7], past_key_values=cache).logits, expected, rtol=0, atol=0)
