"""Unclear errors and silent results found by probing as a new user would (issue "nothing lost, round five"): each
input now gets an error naming it and the fix, before any work, or an exact result."""

import pytest
import torch
from ran_testing import CONFIG_ERROR, randomize_, tiny_config

from ran_hf import (
    RANCache,
    RANForCausalLM,
    RANForPrefixLM,
    RANForQuestionAnswering,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
)


IDS = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("labels", [[0, 1], (0, 1)], ids=["list", "tuple"])
def test_classifier_labels_that_are_not_a_tensor_are_named(labels):
    model = randomize_(RANForSequenceClassification(tiny_config(num_labels=3)))
    with pytest.raises(ValueError, match=r"`labels` must be a tensor, got (list|tuple): pass `torch.tensor"):
        model(IDS, labels=labels)


def test_float_labels_say_that_their_dtype_chose_multi_label_classification():
    model = randomize_(RANForSequenceClassification(tiny_config(num_labels=3)))
    with pytest.raises(ValueError, match=r"chosen from the labels' dtype torch.float32.*integer class ids"):
        model(IDS, labels=torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("model_class", [RANModel, RANForCausalLM])
def test_embeddings_wider_than_the_weights_are_named(model_class):
    model = randomize_(model_class(tiny_config(is_causal=model_class is RANForCausalLM)))
    with pytest.raises(
        ValueError, match=r"`inputs_embeds` are torch.float64, but the model's weights are torch.float32"
    ):
        model(inputs_embeds=torch.randn(2, 9, 16, dtype=torch.float64))


def test_embeddings_narrower_than_the_weights_still_run():
    """bfloat16 embeddings into a float32 model are promoted by the first norm, as before: not refused."""
    model = randomize_(RANModel(tiny_config()))
    embeds = torch.randn(2, 9, 16)
    with torch.no_grad():
        narrow = model(inputs_embeds=embeds.bfloat16()).last_hidden_state
        wide = model(inputs_embeds=embeds).last_hidden_state
    assert narrow.dtype == torch.float32
    assert (narrow - wide).abs().max() < 0.1  # the input's bfloat16 rounding, no more


def test_a_decoding_step_with_embeddings_wider_than_the_weights_is_named():
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True)))
    with torch.no_grad():
        cache = model(IDS, use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"`inputs_embeds` are torch.float64"):
            model(inputs_embeds=torch.randn(2, 1, 16, dtype=torch.float64), past_key_values=cache)


def test_reordering_a_cache_to_rows_it_does_not_hold_is_named_and_changes_nothing():
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True)))
    with torch.no_grad():
        cache = model(IDS, use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"given rows \[0, 5\], but the cache holds 2 rows"):
            cache.reorder_cache(torch.tensor([0, 5]))
        torch.testing.assert_close(  # the cache still continues the text
            model(IDS[:, :1], past_key_values=cache).logits,
            model(torch.cat([IDS, IDS[:, :1]], 1)).logits[:, -1:],
            rtol=1e-5,
            atol=1e-5,
        )


def test_a_prefix_lm_source_given_as_a_list_is_named():
    model = randomize_(RANForPrefixLM(tiny_config()))
    with pytest.raises(ValueError, match=r"The source must be a tensor of token ids, got list"):
        model.generate([[1, 2, 3]], max_new_tokens=3)


def test_prefix_lm_labels_with_no_target_token_are_refused_not_scored_as_zero():
    model = randomize_(RANForPrefixLM(tiny_config()))
    with pytest.raises(ValueError, match=r"mark every token as source"):
        model(IDS, labels=IDS, token_type_ids=torch.zeros_like(IDS))
    loss = model(IDS, labels=IDS, token_type_ids=(torch.arange(9) >= 5).long().expand(2, -1)).loss
    assert loss > 0  # with a target, it is scored


def test_saves_of_either_kind_leave_no_stale_weights_behind(tmp_path):
    """A sharded save over a save in one file left `model.safetensors`, which loading then read (the old weights);
    a save in one file over a sharded one left the shards' index."""
    first = randomize_(RANForCausalLM(tiny_config(is_causal=True)), seed=1)
    second = randomize_(RANForCausalLM(tiny_config(is_causal=True)), seed=2)

    def weight_files():
        return sorted(path.name for path in tmp_path.iterdir() if "safetensors" in path.name)

    def loaded_equals(model):
        loaded = RANForCausalLM.from_pretrained(tmp_path)
        return all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))

    first.save_pretrained(tmp_path)
    second.save_pretrained(tmp_path, max_shard_size=4000)
    assert "model.safetensors" not in weight_files() and "model.safetensors.index.json" in weight_files()
    assert loaded_equals(second)
    first.save_pretrained(tmp_path)
    assert weight_files() == ["model.safetensors"]
    assert loaded_equals(first)


def test_a_causal_models_folder_does_not_load_as_a_masked_lm(tmp_path):
    """`AutoModelForMaskedLM` on a causal folder built a masked LM that read the left context only, with no word."""
    from transformers import AutoModelForMaskedLM

    RANForCausalLM(tiny_config(is_causal=True)).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"RANForMaskedLM fills a mask from the words on both sides.*AutoModelForCausalLM"
    ):
        AutoModelForMaskedLM.from_pretrained(tmp_path)
    with pytest.raises(CONFIG_ERROR, match="`associative_memory` and `cutoffs` belong to the causal LM"):
        AutoModelForMaskedLM.from_pretrained(tmp_path, is_causal=False)  # the causal memory cannot read both ways
    # asked for, without the causal memory (and so without its key convolution): it reads both ways
    encoder = AutoModelForMaskedLM.from_pretrained(tmp_path, is_causal=False, associative_memory=False)
    assert not encoder.config.is_causal
    # and the memory turned on at loading brings its convolution, as a new config's does
    plain_folder = tmp_path / "without_memory"
    RANForCausalLM(tiny_config(is_causal=True, associative_memory=False)).save_pretrained(plain_folder)
    with_memory = RANForCausalLM.from_pretrained(plain_folder, associative_memory=True)
    assert with_memory.config.associative_key_conv == 4


@pytest.mark.parametrize("head", [RANForSequenceClassification, RANForQuestionAnswering, RANForTokenClassification])
def test_a_task_head_given_a_tokenizers_pair_ids_computes_as_without_them(head):
    """A BERT-style tokenizer's `token_type_ids` (0 for the first text, 1 for the second) switched on the prefix-LM
    mask in these heads, and changed their logits (by 0.09 for the QA head). The masked LM still reads them: with
    them it is the official seq2seq network (tests/test_prefix_lm.py)."""
    model = randomize_(head(tiny_config(num_labels=3)))
    pair_ids = (torch.arange(9) >= 4).long().expand(2, -1)
    with torch.no_grad():
        plain, paired = model(IDS), model(IDS, token_type_ids=pair_ids)
    for name in ("logits", "start_logits", "end_logits"):
        if name in plain:
            assert torch.equal(plain[name], paired[name]), name


def test_speculative_decoding_is_refused_before_any_work_and_a_cache_cannot_drop_draft_tokens():
    """Assisted and prompt-lookup decoding would need a cache cropped back to before rejected draft tokens, which a
    recurrent state cannot be: refused before a token is generated, and so is cropping."""
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True)))
    with pytest.raises(ValueError, match="stateful"):
        model.generate(IDS, prompt_lookup_num_tokens=3, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cache = model(IDS, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="crop"):
        cache.crop(2)


def test_a_cache_handed_to_generate_grows_with_what_is_generated_not_with_max_new_tokens():
    """Eager `generate()` reserved a handed `RANCache` for `max_new_tokens` at once: 1 GiB for a tiny model at
    10**7, however early EOS ended it."""
    from ran_hf import RANCache

    model = randomize_(RANForCausalLM(tiny_config(is_causal=True)))
    first = model.generate(IDS[:1], max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1].item()
    cache = RANCache(model.config)
    generated = model.generate(
        IDS[:1], past_key_values=cache, max_new_tokens=10**7, eos_token_id=first, do_sample=False, pad_token_id=0
    )
    assert generated.shape[1] == IDS.shape[1] + 1  # EOS at once
    assert cache.nbytes() < 64 * 1024  # the cells of 10**7 tokens would be 2 windows' keys of 16 floats x 2M windows


@pytest.mark.parametrize(
    "options",
    [{"num_beams": 3, "num_return_sequences": 2}, {"num_return_sequences": 3, "do_sample": True}],
    ids=["beam-search", "sampled-sequences"],
)
def test_beam_search_and_several_sequences_continue_a_returned_cache(options):
    """Each row of the cache is repeated as `generate` repeats the row's text: the tokens of reading it all anew."""
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True))).eval()
    first = model.generate(IDS[:, :6], max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    text = torch.cat([first.sequences, IDS[:, 6:8]], dim=1)
    torch.manual_seed(1)
    continued = model.generate(text, past_key_values=first.past_key_values, max_new_tokens=6, **options)
    torch.manual_seed(1)
    anew = model.generate(text, max_new_tokens=6, **options)
    assert continued.shape[0] == 2 * (options["num_return_sequences"])
    torch.testing.assert_close(continued, anew, rtol=0, atol=0)


@pytest.mark.parametrize(
    "options",
    [{}, {"window_overlap": 2}, {"memory_review_cells": 2}, {"use_cell_residual": False}],
    ids=["plain", "overlap", "bounded-review", "no-cell-residual"],
)
def test_the_exportable_scan_continues_a_cache_as_the_reference_does(options):
    """A text read in two chunks through the `export` scan: its first window after the cache adds the cell residual
    of the window before, as the reference scan's does (and one forward over the whole text)."""
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True, scan_implementation="export", **options))).eval()
    ids = torch.randint(1, 61, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first = model(ids[:, :9], use_cache=True)
        second = model(ids[:, 9:], past_key_values=first.past_key_values, use_cache=True)
        model.config.scan_implementation = "reference"
        whole = model(ids).logits
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole, rtol=0, atol=1e-5)


@pytest.mark.slow  # compiles a decoding step
def test_a_compiled_step_past_its_caches_room_is_refused_not_written_over_the_last_cell():
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True, window_size=2, min_window_size=1))).eval()
    step = torch.compile(model, fullgraph=True)
    token = torch.ones(1, 1, dtype=torch.long)
    with torch.no_grad():
        cache = model(IDS[:1, :3], use_cache=True).past_key_values  # room for the cells of 3 tokens
        with pytest.raises(RuntimeError, match=r"ran past the room its RANCache holds.*cache.reserve\(N\)"):
            for _ in range(4):
                step(token, past_key_values=cache, use_cache=True)
        reserved = model(IDS[:1, :3], past_key_values=RANCache(model.config, max_cache_len=16), use_cache=True)
        eager = model(IDS[:1, :3], use_cache=True).past_key_values
        for _ in range(8):  # with room, the compiled steps give the eager ones' logits
            compiled_logits = step(token, past_key_values=reserved.past_key_values, use_cache=True).logits
            torch.testing.assert_close(compiled_logits, model(token, past_key_values=eager).logits, rtol=0, atol=1e-4)


def test_a_ran_drafting_for_another_model_is_refused_before_either_model_runs():
    """A RAN as another model's `assistant_model` drafted, the main model verified, and only then did the draft's
    cache fail to drop the rejected tokens (`A RAN cache cannot be cropped`): now refused at the draft's first call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    main = LlamaForCausalLM(
        LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)
    ).eval()  # fmt: skip
    draft = randomize_(RANForCausalLM(tiny_config(is_causal=True)))
    forwards = []
    for model in (main, draft):
        model.register_forward_hook(lambda module, args, output: forwards.append(type(module).__name__))
    with pytest.raises(ValueError, match=r"RANForCausalLM cannot draft for assisted generation.*cannot be cropped"):
        main.generate(IDS[:1], assistant_model=draft, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert forwards == []


def test_an_onnx_export_of_salient_cells_is_refused_before_tracing():
    """`memory_salient_cells` failed in ONNX's converter after tracing (no function for a stable `aten.sort`)."""
    from ran_hf import export_onnx

    model = randomize_(RANForCausalLM(tiny_config(is_causal=True, memory_review_cells=1, memory_salient_cells=1)))
    model.register_forward_pre_hook(lambda *_: pytest.fail("traced before refusing"))
    with pytest.raises(NotImplementedError, match=r"`memory_salient_cells` cannot be exported to ONNX"):
        export_onnx(model)


def test_an_export_into_a_path_inside_a_file_is_refused_before_tracing(tmp_path):
    """`model.safetensors/model.onnx` traced the model, then failed making the folder: `FileExistsError`."""
    from ran_hf import export_onnx

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    model = randomize_(RANModel(tiny_config()))
    model.register_forward_pre_hook(lambda *_: pytest.fail("traced before refusing"))
    with pytest.raises(ValueError, match=r"cannot be written: .*model.safetensors is a file, not a folder"):
        export_onnx(model, weights / "sub" / "model.onnx")
    assert weights.read_bytes() == b"weights"
