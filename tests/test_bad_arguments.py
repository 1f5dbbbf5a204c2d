"""Bad arguments, kept as regression tests and grouped by kind:

- a model given a cache it cannot continue, or a config changed after it was built;
- script flags out of range, refused before any tokenizer is trained, data read or model built;
- inputs that used to cost memory in proportion to their longest line, now read in pieces.
"""

import pytest
import torch
from transformers import DynamicCache

from ran_hf import RANCache, RANConfig, RANForCausalLM


def tiny_causal_lm(**overrides) -> RANForCausalLM:
    fields = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8}
    fields |= {"window_size": 8, "min_window_size": 2, "is_causal": True}
    return RANForCausalLM(RANConfig(**{**fields, **overrides})).eval()


@pytest.fixture
def tokens():
    return torch.randint(1, 50, (2, 13), generator=torch.Generator().manual_seed(0))


# ---- model: a cache it cannot continue ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cache, kind",
    [
        pytest.param(DynamicCache(), "DynamicCache", id="a transformer's cache"),
        pytest.param(((torch.zeros(2, 2, 13, 8),) * 2,), "tuple", id="legacy tuples"),
    ],
)
def test_a_cache_of_another_kind_is_refused(tokens, cache, kind):
    """Both failed with `AttributeError: ... has no attribute 'past_lengths'`."""
    with pytest.raises(TypeError, match=rf"`past_key_values` must be a RANCache .*got {kind}"):
        tiny_causal_lm()(tokens, past_key_values=cache)


@pytest.mark.parametrize(
    "other, named",
    [
        pytest.param({"num_hidden_layers": 2}, "num_hidden_layers 2 there, 1 here", id="more layers"),
        pytest.param({"hidden_size": 32, "head_dim": 16}, "hidden_size 32 there, 16 here", id="wider"),
        pytest.param({"window_size": 4}, "window_size 4 there, 8 here", id="other windows"),
        pytest.param({"memory_review_cells": 2}, "memory_review_cells 2 there, None here", id="bounded review"),
    ],
)
def test_a_cache_of_another_model_is_refused_naming_the_difference(tokens, other, named):
    with torch.no_grad():
        cache = tiny_causal_lm(**other)(tokens, use_cache=True).past_key_values
        with pytest.raises(ValueError, match=rf"`past_key_values` was made by another model \(.*{named}"):
            tiny_causal_lm()(tokens, past_key_values=cache)


def test_a_cache_of_a_model_of_the_same_shape_continues(tokens):
    model = tiny_causal_lm()
    with torch.no_grad():
        whole = model(tokens).logits
        cache = model(tokens[:, :9], past_key_values=RANCache(model.config), use_cache=True).past_key_values
        continued = model(tokens[:, 9:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(continued, whole[:, 9:], atol=1e-5, rtol=1e-4)


# ---- model: a config changed after the model was built --------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        pytest.param({"window_size": 0}, r"`window_size` must be >= 1, got 0", id="window_size 0"),
        pytest.param(
            {"window_size": 4, "min_window_size": 6}, r"`min_window_size` \(6\) must be smaller", id="min over window"
        ),
        pytest.param({"window_overlap": -1}, r"`window_overlap` must be >= 0", id="negative overlap"),
        pytest.param({"hidden_dropout_prob": float("nan")}, r"`hidden_dropout_prob` must be finite", id="nan dropout"),
        pytest.param({"cell_pooling": "median"}, r"`cell_pooling` must be one of", id="unknown pooling"),
        pytest.param({"memory_salient_cells": 2}, r"`memory_salient_cells` keeps salient cells", id="salient alone"),
    ],
)
def test_a_config_field_changed_after_building_is_checked_when_the_model_runs(tokens, changes, message):
    model = tiny_causal_lm()
    model(tokens)
    for name, value in changes.items():
        setattr(model.config, name, value)
    with pytest.raises(ValueError, match=rf"config was changed after the model was built and is not valid: {message}"):
        model(tokens)


def test_a_valid_change_runs_and_a_fix_is_seen(tokens):
    model = tiny_causal_lm()
    model.config.window_size = 0
    with pytest.raises(ValueError, match="window_size"):
        model(tokens)
    model.config.window_size = 4  # a valid value: the model runs with windows of 4
    with torch.no_grad():
        assert model(tokens).logits.shape == (2, 13, 50)
