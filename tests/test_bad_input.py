"""Malformed inputs, labels and configurations fail early with a clear ValueError (rows of padding only are
test_padding_invariance.py's)."""

import json
import logging
import math
from unittest import mock

import pytest
import torch
from ran_testing import CONFIG_ERROR
from transformers import AutoConfig

from ran_hf import (
    RANConfig,
    RANForCausalLM,
    RANForMaskedLM,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
    ran_model,
)


HEADS = [
    pytest.param(RANModel, id="model"),
    pytest.param(RANForMaskedLM, id="masked-lm"),
    pytest.param(RANForSequenceClassification, id="sequence-classification"),
    pytest.param(RANForTokenClassification, id="token-classification"),
]

BATCH_SIZE, LENGTH = 2, 7


@pytest.fixture
def input_ids():
    return torch.randint(1, 64, (BATCH_SIZE, LENGTH), generator=torch.Generator().manual_seed(0))


# ---- inputs ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", HEADS)
@pytest.mark.parametrize(
    "bad_id",
    [pytest.param(-1, id="negative"), pytest.param(64, id="vocab-size"), pytest.param(10_000, id="far-above")],
)
def test_token_ids_outside_the_vocabulary(make_config, input_ids, model_class, bad_id):
    """An id outside [0, vocab_size) is named, instead of an index error deep in the embedding."""
    model = model_class(make_config())
    input_ids[1, 3] = bad_id
    with pytest.raises(ValueError, match=rf"token id {bad_id}, outside the vocabulary \[0, 63\]"):
        model(input_ids=input_ids)


@pytest.mark.parametrize("model_class", HEADS)
@pytest.mark.parametrize(
    "mask_shape",
    [
        pytest.param((BATCH_SIZE, LENGTH + 1), id="too-long"),
        pytest.param((BATCH_SIZE + 1, LENGTH), id="too-many-rows"),
        pytest.param((LENGTH,), id="one-dimensional"),
        pytest.param((BATCH_SIZE, 1, LENGTH), id="three-dimensional"),
    ],
)
def test_attention_mask_of_the_wrong_shape(make_config, input_ids, model_class, mask_shape):
    """An attention mask that does not match the inputs is rejected, naming both shapes."""
    model = model_class(make_config())
    with pytest.raises(ValueError, match=r"`attention_mask` must have the shape of the inputs \(2, 7\)"):
        model(input_ids=input_ids, attention_mask=torch.ones(mask_shape, dtype=torch.long))


@pytest.mark.parametrize("model_class", HEADS)
@pytest.mark.parametrize("as_embeds", [pytest.param(False, id="input_ids"), pytest.param(True, id="inputs_embeds")])
def test_sequences_of_length_zero(make_config, model_class, as_embeds):
    """Empty sequences are rejected: RAN needs at least one token to build a window."""
    config = make_config()
    model = model_class(config)
    if as_embeds:
        inputs = {"inputs_embeds": torch.zeros(BATCH_SIZE, 0, config.hidden_size)}
    else:
        inputs = {"input_ids": torch.zeros(BATCH_SIZE, 0, dtype=torch.long)}
    with pytest.raises(ValueError, match="sequences of length 0"):
        model(**inputs)


@pytest.mark.parametrize("model_class", HEADS)
@pytest.mark.parametrize("both", [pytest.param(True, id="both"), pytest.param(False, id="neither")])
def test_exactly_one_of_input_ids_and_inputs_embeds(make_config, input_ids, model_class, both):
    """Passing both `input_ids` and `inputs_embeds`, or neither, is an error."""
    model = model_class(make_config())
    inputs = {"input_ids": input_ids, "inputs_embeds": model.get_input_embeddings()(input_ids)} if both else {}
    with pytest.raises(ValueError, match="exactly one of `input_ids` or `inputs_embeds`"):
        model(**inputs)


@pytest.mark.parametrize("model_class", HEADS)
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((BATCH_SIZE, LENGTH, 17), id="too-wide"),
        pytest.param((BATCH_SIZE, LENGTH, 8), id="too-narrow"),
        pytest.param((BATCH_SIZE, 16), id="two-dimensional"),
    ],
)
def test_inputs_embeds_of_the_wrong_width(make_config, model_class, shape):
    """Embeddings whose last axis is not `hidden_size` are rejected, naming the expected shape."""
    model = model_class(make_config())
    with pytest.raises(ValueError, match=r"`inputs_embeds` must have shape \(batch_size, sequence_length, 16\)"):
        model(inputs_embeds=torch.randn(shape))


@pytest.mark.parametrize(
    "bad_input_ids, message",
    [
        pytest.param(torch.ones(BATCH_SIZE, LENGTH), "must hold integer token ids", id="float-ids"),
        pytest.param(
            torch.ones(LENGTH, dtype=torch.long), r"must have shape \(batch_size, sequence_length\)", id="1d"
        ),
    ],
)
def test_input_ids_of_the_wrong_kind(make_config, bad_input_ids, message):
    """Float or one-dimensional `input_ids` are named as such."""
    with pytest.raises(ValueError, match=message):
        RANModel(make_config())(input_ids=bad_input_ids)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool])
def test_input_ids_of_a_dtype_the_embedding_does_not_take(make_config, input_ids, dtype):
    """Only int64 and int32 ids index an embedding; other dtypes are named before the model runs."""
    model = RANModel(make_config())
    with pytest.raises(ValueError, match=rf"int64 or int32\), got dtype {dtype}"):
        model(input_ids=input_ids.to(dtype))
    assert model(input_ids=input_ids.int()).last_hidden_state.shape == (BATCH_SIZE, LENGTH, 16)


@pytest.mark.parametrize("model_class", HEADS)
@pytest.mark.parametrize(
    "mask_values, bad_value",
    [
        pytest.param((0.0, -10_000.0), "-10000.0", id="additive-0-and-minus-1e4"),
        pytest.param((0.0, float("-inf")), "-inf", id="additive-minus-inf"),
        pytest.param((1, 2), "2", id="two"),
        pytest.param((1.0, 0.5), "0.5", id="fraction"),
    ],
)
def test_attention_mask_that_is_not_zero_or_one(make_config, input_ids, model_class, mask_values, bad_value):
    """An additive mask (0 for tokens, a large negative number for padding) was read inverted: every value but 0/1 is
    rejected. Masks of 0/1 in any dtype, bool included, give the same outputs."""
    real, padding = mask_values
    mask = torch.full((BATCH_SIZE, LENGTH), real)
    mask[1, 5:] = padding
    model = model_class(make_config()).eval()
    message = rf"`attention_mask` must hold 1 for real tokens and 0 for padding, got {bad_value}\."
    with pytest.raises(ValueError, match=message):
        model(input_ids=input_ids, attention_mask=mask)
    binary = torch.ones(BATCH_SIZE, LENGTH, dtype=torch.long)
    binary[1, 5:] = 0
    dtypes = (torch.long, torch.float, torch.bool)
    outputs = [model(input_ids=input_ids, attention_mask=binary.to(dtype))[0] for dtype in dtypes]
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


@pytest.mark.parametrize("model_class", HEADS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "minus-inf"])
def test_non_finite_inputs_embeds(make_config, model_class, value):
    """One NaN or infinite entry would turn every later state of its sequence into NaN: rejected instead."""
    embeds = torch.randn(BATCH_SIZE, LENGTH, 16)
    embeds[1, 3, 5] = value
    with pytest.raises(ValueError, match="`inputs_embeds` holds NaN or infinite values"):
        model_class(make_config())(inputs_embeds=embeds)


def additive_mask():
    mask = torch.zeros(BATCH_SIZE, LENGTH, dtype=torch.long)
    mask[1, 5:] = -10_000
    return mask


def nan_embeds():
    embeds = torch.randn(BATCH_SIZE, LENGTH, 16)
    embeds[1, 3, 5] = float("nan")
    return embeds


@pytest.mark.parametrize(
    "inputs, message",
    [
        pytest.param(
            lambda ids: {"input_ids": ids, "attention_mask": additive_mask()}, "0 for padding", id="additive"
        ),
        pytest.param(lambda ids: {"input_ids": ids.clamp(max=64) * 2}, r"token id outside \[0, 63\]", id="ids"),
        pytest.param(lambda ids: {"inputs_embeds": nan_embeds()}, "`inputs_embeds` holds NaN", id="nan-embeds"),
        pytest.param(
            lambda ids: {"input_ids": ids, "initial_cell": torch.full((BATCH_SIZE, 16), float("nan"))},
            "`initial_cell` holds NaN",
            id="nan-initial-cell",
        ),
    ],
)
def test_a_compiled_model_checks_the_values_of_its_inputs(make_config, input_ids, inputs, message):
    """Compiled, the value checks were skipped (reading them would break the graph): an additive mask was read
    inverted, NaN spread through every later token, all without a word. They are now asserted on the device. (Dynamo's
    capture, run eagerly, here; inductor in the next test; tests/test_compile.py checks good inputs pass.)"""
    torch._dynamo.reset()
    compiled = torch.compile(RANModel(make_config()).eval(), backend="eager")
    with torch.no_grad(), pytest.raises(RuntimeError, match=message):
        compiled(**inputs(input_ids))
    torch._dynamo.reset()


@pytest.mark.slow
def test_an_inductor_compiled_model_refuses_an_additive_mask(make_config, input_ids):
    torch._dynamo.reset()
    compiled = torch.compile(RANModel(make_config()).eval())
    with torch.no_grad(), pytest.raises(RuntimeError, match="must hold 1 for real tokens and 0 for padding"):
        compiled(input_ids=input_ids, attention_mask=additive_mask())
    torch._dynamo.reset()


@pytest.mark.parametrize("model_class", HEADS)
@pytest.mark.parametrize("as_embeds", [pytest.param(False, id="input_ids"), pytest.param(True, id="inputs_embeds")])
def test_a_batch_of_zero_sequences(make_config, model_class, as_embeds):
    """Batch size 0 was a reshape error deep in the window layout; it is named instead."""
    inputs = (
        {"inputs_embeds": torch.zeros(0, LENGTH, 16)}
        if as_embeds
        else {"input_ids": torch.zeros(0, LENGTH, dtype=torch.long)}
    )
    with pytest.raises(ValueError, match="a batch of 0 sequences"):
        model_class(make_config())(**inputs)


# ---- labels ------------------------------------------------------------------------------------------------------

MASKED_LM = (RANForMaskedLM, {})
TOKENS = (RANForTokenClassification, {"num_labels": 5})
SINGLE = (RANForSequenceClassification, {"num_labels": 3})
SINGLE_SET = (RANForSequenceClassification, {"num_labels": 3, "problem_type": "single_label_classification"})
MULTI_SET = (RANForSequenceClassification, {"num_labels": 3, "problem_type": "multi_label_classification"})
REGRESSION = (RANForSequenceClassification, {"num_labels": 1})

LABEL_ERRORS = [
    # (head, config overrides), labels, message fragment
    pytest.param(MASKED_LM, torch.ones(2, 6, dtype=torch.long), r"must have shape \(2, 7\)", id="masked-lm-shape"),
    pytest.param(MASKED_LM, torch.ones(2, 7), "must hold integer token ids", id="masked-lm-float"),
    pytest.param(MASKED_LM, torch.full((2, 7), 64), r"token id outside \[0, 63\]", id="masked-lm-id-too-large"),
    pytest.param(MASKED_LM, torch.full((2, 7), -5), r"token id outside \[0, 63\]", id="masked-lm-negative-id"),
    pytest.param(TOKENS, torch.zeros(2, 7), "must hold integer class ids", id="token-float"),
    pytest.param(TOKENS, torch.zeros(2, 7, dtype=torch.bool), "must hold integer class ids", id="token-bool"),
    pytest.param(TOKENS, torch.full((2, 7), 5), r"class id outside \[0, 4\]", id="token-class-too-large"),
    pytest.param(TOKENS, torch.zeros(2, 8, dtype=torch.long), r"must have shape \(2, 7\)", id="token-shape"),
    pytest.param(TOKENS, torch.zeros(2, dtype=torch.long), r"must have shape \(2, 7\)", id="token-one-per-row"),
    pytest.param(SINGLE, torch.tensor([0, 3]), r"class outside \[0, 2\]", id="single-label-class-too-large"),
    pytest.param(SINGLE, torch.tensor([0, -2]), r"class outside \[0, 2\]", id="single-label-negative-class"),
    pytest.param(SINGLE, torch.tensor([[0], [1]]), r"integer labels of shape \(2,\)", id="single-label-column"),
    pytest.param(SINGLE_SET, torch.tensor([0.0, 1.0]), r"integer labels of shape \(2,\)", id="single-label-float"),
    pytest.param(SINGLE, torch.tensor([0, 1, 2]), "one row per example", id="sequence-too-many-rows"),
    pytest.param(SINGLE, torch.tensor(1), "one row per example", id="sequence-scalar"),
    pytest.param(MULTI_SET, torch.zeros(2, 4), r"labels of shape \(2, 3\)", id="multi-label-too-wide"),
    pytest.param(SINGLE, torch.zeros(2, 2), r"labels of shape \(2, 3\)", id="multi-label-inferred-too-narrow"),
    pytest.param(REGRESSION, torch.zeros(2, 2), "Regression needs 1 target", id="regression-two-targets"),
]


@pytest.mark.parametrize("head, labels, message", LABEL_ERRORS)
def test_labels_of_the_wrong_shape_dtype_or_range(make_config, input_ids, head, labels, message):
    """Labels that do not fit the head (shape, dtype, class range) are rejected before the forward pass."""
    model_class, overrides = head
    model = model_class(make_config(**overrides))
    with pytest.raises(ValueError, match=message):
        model(input_ids=input_ids, labels=labels)


@pytest.mark.parametrize(
    "head, labels",
    [
        pytest.param(MASKED_LM, torch.ones(BATCH_SIZE, LENGTH).long(), id="masked-lm"),
        pytest.param((RANForCausalLM, {}), torch.ones(BATCH_SIZE, LENGTH).long(), id="causal-lm"),
        pytest.param(TOKENS, torch.zeros(BATCH_SIZE, LENGTH).long(), id="token-classification"),
        pytest.param(SINGLE, torch.zeros(BATCH_SIZE).long(), id="sequence-classification"),
    ],
)
def test_a_labelled_forward_validates_its_inputs_once(make_config, input_ids, head, labels):
    """Heads check their labels' shape themselves and leave the inputs' values to one check in `RANModel`."""
    model_class, overrides = head
    model = model_class(make_config(**overrides)).eval()
    with mock.patch.object(ran_model, "validate_ran_inputs", wraps=ran_model.validate_ran_inputs) as validate:
        model(input_ids=input_ids, labels=labels)
    assert validate.call_count == 1


@pytest.mark.parametrize(
    "targets, shown",
    [
        pytest.param([[2.0, 0.0, 1.0], [0.0, 1.0, 1.0]], "2.0", id="above-one"),
        pytest.param([[0.0, 0.0, 1.0], [0.0, -1.0, 1.0]], "-1.0", id="negative"),
        pytest.param([[0.0, 0.0, 1.0], [0.0, -100.0, 1.0]], "-100.0", id="ignore-index"),
        pytest.param([[0.0, float("nan"), 1.0], [0.0, 0.0, 1.0]], "nan", id="nan"),
    ],
)
def test_multi_label_targets_outside_zero_one(make_config, input_ids, targets, shown):
    """Binary cross-entropy with targets outside [0, 1] is a number without meaning: rejected, naming the value."""
    model = RANForSequenceClassification(make_config(**MULTI_SET[1]))
    with pytest.raises(ValueError, match=rf"targets in \[0, 1\] \(1: the class applies\), got {shown}"):
        model(input_ids=input_ids, labels=torch.tensor(targets))
    soft = torch.tensor([[0.0, 0.25, 1.0], [1.0, 0.5, 0.0]])  # soft targets inside [0, 1] are fine
    assert torch.isfinite(model(input_ids=input_ids, labels=soft).loss)


def test_regression_targets_that_are_not_finite(make_config, input_ids):
    model = RANForSequenceClassification(make_config(**REGRESSION[1]))
    with pytest.raises(ValueError, match="Regression targets hold NaN or infinite values"):
        model(input_ids=input_ids, labels=torch.tensor([0.5, float("nan")]))


@pytest.mark.parametrize(
    "logits_to_keep", [1, LENGTH - 1, torch.tensor([0, 3])], ids=["last", "all-but-one", "positions"]
)
def test_causal_lm_labels_with_logits_to_keep(make_config, input_ids, logits_to_keep):
    """The loss scores every position, so it cannot be computed from some of the logits: a clear error instead of a
    batch-size mismatch inside the loss."""
    model = RANForCausalLM(make_config(is_causal=True))
    with pytest.raises(ValueError, match="`labels` are scored at every position, but `logits_to_keep`"):
        model(input_ids=input_ids, labels=input_ids, logits_to_keep=logits_to_keep)
    assert model(input_ids=input_ids, logits_to_keep=1).logits.shape == (BATCH_SIZE, 1, 64)


def nothing_to_score(task, input_ids):
    """Labels where no position or document counts: all -100 (or, for a causal LM, a single token)."""
    if task == "causal-one-token":
        return input_ids[:, :1], input_ids[:, :1]
    if task == "single-label":
        return input_ids, torch.full((BATCH_SIZE,), -100)
    return input_ids, torch.full_like(input_ids, -100)


NOTHING_TO_SCORE = {
    "masked-lm": (RANForMaskedLM, {}),
    "causal-lm": (RANForCausalLM, {"is_causal": True}),
    "causal-one-token": (RANForCausalLM, {"is_causal": True}),
    "token-classification": (RANForTokenClassification, {"num_labels": 5}),
    "single-label": (RANForSequenceClassification, {"num_labels": 3}),
}


@pytest.mark.parametrize("task", list(NOTHING_TO_SCORE))
def test_a_batch_with_nothing_to_score_has_zero_loss(make_config, input_ids, task):
    """A batch whose labels are all -100 (a masked-LM batch where nothing was masked, say) gave a NaN loss, which
    poisons training: its loss is 0, with finite (zero) gradients."""
    model_class, overrides = NOTHING_TO_SCORE[task]
    model = model_class(make_config(**overrides)).train()
    inputs, labels = nothing_to_score(task, input_ids)
    loss = model(input_ids=inputs, labels=labels).loss
    assert loss.item() == 0.0 and not math.copysign(1.0, loss.item()) < 0
    loss.backward()
    assert all(torch.all(p.grad == 0) for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize(
    "fields, labels",
    [
        pytest.param({"num_labels": 3}, torch.tensor([0, 2]), id="single-label"),
        pytest.param(
            {"num_labels": 3, "problem_type": "multi_label_classification"},
            torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]),
            id="multi-label",
        ),
        pytest.param({"num_labels": 1}, torch.tensor([0.5, -1.0]), id="regression"),
    ],
)
def test_sequence_loss_of_a_batch_of_padding_only(make_config, fields, labels):
    """Rows of padding only are left out of the loss (test_padding_invariance.py); when every row is padding, the
    loss is 0, not NaN."""
    model = RANForSequenceClassification(make_config(**fields))
    input_ids = torch.zeros(2, 5, dtype=torch.long)
    assert model(input_ids=input_ids, attention_mask=torch.zeros_like(input_ids), labels=labels).loss.item() == 0.0


# ---- configuration -----------------------------------------------------------------------------------------------

CONFIG_ERRORS = [
    pytest.param(
        {"window_size": 0}, r"(?s)field 'window_size'.*must be finite and in \[2, inf\], got 0", id="window-size-zero"
    ),
    pytest.param(
        {"window_size": -4},
        r"(?s)field 'window_size'.*must be finite and in \[2, inf\], got -4",
        id="window-size-negative",
    ),
    pytest.param({"window_size": 2.5}, r"(?s)field 'window_size'.*TypeError", id="window-size-float"),
    pytest.param({"window_size": "8"}, r"(?s)field 'window_size'.*TypeError", id="window-size-string"),
    pytest.param(
        {"min_window_size": 4}, r"`min_window_size` \(4\) must be smaller than `window_size`", id="min-equal"
    ),
    pytest.param(
        {"min_window_size": 9}, r"`min_window_size` \(9\) must be smaller than `window_size`", id="min-larger"
    ),
    pytest.param({"cell_pooling": "avg"}, r"(?s)field 'cell_pooling'.*TypeError", id="unknown-cell-pooling"),
    pytest.param({"token_pooling": "last"}, r"(?s)field 'token_pooling'.*TypeError", id="unknown-token-pooling"),
    pytest.param({"use_rotary": "no"}, r"(?s)field 'use_rotary'.*TypeError", id="rotary-not-bool"),
    pytest.param({"use_cell_residual": 0}, r"(?s)field 'use_cell_residual'.*TypeError", id="residual-not-bool"),
    pytest.param({"residual_stream": "yes"}, r"(?s)field 'residual_stream'.*TypeError", id="stream-not-bool"),
    pytest.param({"review_qk_norm": 1}, r"(?s)field 'review_qk_norm'.*TypeError", id="qk-norm-not-bool"),
    pytest.param({"review_initial_cell": "no"}, r"(?s)field 'review_initial_cell'.*TypeError", id="sink-not-bool"),
    pytest.param(
        {"window_overlap": -1},
        r"(?s)field 'window_overlap'.*must be finite and in \[0, inf\], got -1",
        id="negative-overlap",
    ),
    pytest.param({"window_overlap": 1.5}, r"(?s)field 'window_overlap'.*TypeError", id="float-overlap"),
    pytest.param(
        {"window_overlap": 4}, r"`window_overlap` \(4\) must be smaller than `window_size`", id="overlap-equal"
    ),
    pytest.param(
        {"window_overlap": 7}, r"`window_overlap` \(7\) must be smaller than `window_size`", id="overlap-larger"
    ),
    pytest.param(
        {"is_causal": True, "memory_review_cells": 0},
        r"(?s)field 'memory_review_cells'.*must be finite and in \[1, inf\], got 0",
        id="bound-zero",
    ),
    pytest.param(
        {"is_causal": True, "memory_review_cells": True},
        r"(?s)field 'memory_review_cells'.*TypeError",
        id="bound-bool",
    ),
    pytest.param({"memory_review_cells": 4}, "bidirectional encoder reviews every cell", id="bound-encoder"),
    pytest.param(
        {"is_causal": True, "memory_salient_cells": 2}, "`memory_review_cells` is None", id="salient-without-bound"
    ),
    pytest.param(
        {"is_causal": True, "memory_review_cells": 4, "memory_salient_cells": 0},
        r"(?s)field 'memory_salient_cells'.*must be finite and in \[1, inf\], got 0",
        id="salient-zero",
    ),
    pytest.param(
        {"is_causal": True, "memory_review_cells": 4, "memory_salient_cells": 2, "review_salience": False},
        "turns off",
        id="salient-without-salience",
    ),
]


@pytest.mark.parametrize("overrides, message", CONFIG_ERRORS)
def test_config_rejects_ill_defined_windows(make_config, overrides, message):
    """Window and pooling settings that would make the layout ill-defined raise ValueError naming the field."""
    with pytest.raises(CONFIG_ERROR, match=message):
        make_config(**overrides)


CONFIG_TYPE_ERRORS = [
    pytest.param(
        {"layer_norm_eps": float("nan")},
        r"(?s)field 'layer_norm_eps'.*must be finite and in \(0, inf\], got nan",
        id="eps-nan",
    ),
    pytest.param(
        {"layer_norm_eps": float("inf")},
        r"(?s)field 'layer_norm_eps'.*must be finite and in \(0, inf\], got inf",
        id="eps-inf",
    ),
    pytest.param({"layer_norm_eps": None}, r"(?s)field 'layer_norm_eps'.*TypeError", id="eps-none"),
    pytest.param({"rope_theta": float("inf")}, r"`rope_theta` must be finite and > 0, got inf\.", id="rope-theta-inf"),
    pytest.param({"rope_theta": float("nan")}, r"`rope_theta` must be finite and > 0, got nan\.", id="rope-theta-nan"),
    pytest.param(
        {"rope_theta": "10000"}, r"`rope_theta` must be finite and > 0, got '10000'\.", id="rope-theta-string"
    ),
    pytest.param({"hidden_dropout_prob": None}, r"(?s)field 'hidden_dropout_prob'.*TypeError", id="dropout-none"),
    pytest.param(
        {"attention_probs_dropout_prob": "0.1"},
        r"(?s)field 'attention_probs_dropout_prob'.*TypeError",
        id="dropout-str",
    ),
    pytest.param(
        {"hidden_dropout_prob": float("nan")},
        r"(?s)field 'hidden_dropout_prob'.*must be finite and in \[0, 1\), got nan",
        id="dropout-nan",
    ),
    pytest.param(
        {"initializer_range": -0.02},
        r"(?s)field 'initializer_range'.*must be finite and in \[0, inf\], got -0\.02",
        id="negative-init",
    ),
    pytest.param({"initializer_range": True}, r"(?s)field 'initializer_range'.*TypeError", id="init-bool"),
    pytest.param({"hidden_size": None}, r"(?s)field 'hidden_size'.*TypeError", id="hidden-size-none"),
    pytest.param({"num_hidden_layers": "2"}, r"(?s)field 'num_hidden_layers'.*TypeError", id="layers-string"),
    pytest.param(
        {"hidden_act": "swishy"},
        r"(?s)field 'hidden_act'.*must be the name of a Transformers activation \(gelu, gelu_10, gelu_accurate, gelu_fast, gelu_new, gelu_python, gelu_python_tanh, gelu_pytorch_tanh, hardswish, laplace, leaky_relu, linear, mish, prelu, quick_gelu, relu, relu2, relu6, sigmoid, silu, sqrtsoftplus, swish, tanh, xielu\), got 'swishy'",
        id="unknown-act",
    ),
    pytest.param({"hidden_act": None}, r"(?s)field 'hidden_act'.*TypeError", id="act-none"),
    pytest.param({"tie_word_embeddings": "yes"}, r"(?s)field 'tie_word_embeddings'.*TypeError", id="tie-not-bool"),
    pytest.param({"pad_token_id": 64}, r"`pad_token_id` \(64\) is outside the vocabulary \[0, 63\]", id="pad-id-64"),
    pytest.param({"pad_token_id": -1}, r"`pad_token_id` \(-1\) is outside the vocabulary", id="pad-id-negative"),
    pytest.param({"pad_token_id": 1.0}, r"(?s)field 'pad_token_id'.*TypeError", id="pad-id-float"),
    pytest.param({"bos_token_id": 99}, r"`bos_token_id` \(99\) is outside the vocabulary", id="bos-id"),
    pytest.param({"eos_token_id": [2, 64]}, r"`eos_token_id` \(64\) is outside the vocabulary", id="eos-id-list"),
]


@pytest.mark.parametrize("overrides, message", CONFIG_TYPE_ERRORS)
def test_config_rejects_wrong_types_and_non_finite_values(make_config, overrides, message):
    """Every field is checked at construction, its type included; the error names the field (before, NaN and
    infinite floats, unknown activations, negative init ranges and out-of-vocabulary pad ids were accepted, and None
    or strings in float fields gave a bare TypeError)."""
    with pytest.raises(CONFIG_ERROR, match=message):
        make_config(**overrides)


def test_salient_cells_set_on_a_trained_model_without_a_bound_are_named_before_the_forward(make_config, input_ids):
    """`memory_salient_cells` may be set after the config was checked; the forward pass then checks it."""
    model = RANForCausalLM(make_config(is_causal=True))
    model.config.memory_salient_cells = 2
    with pytest.raises(CONFIG_ERROR, match="`memory_review_cells` is None"):
        model(input_ids)
    model.config.memory_review_cells = 1
    assert torch.isfinite(model(input_ids).logits).all()


def test_config_accepts_valid_special_token_ids(make_config):
    config = make_config(pad_token_id=None, bos_token_id=1, eos_token_id=[2, 63], initializer_range=0.0)
    assert config.eos_token_id == [2, 63] and config.pad_token_id is None


def test_a_keyword_that_is_no_field_is_refused(make_config):
    """A typo such as `windowsize=8` was stored silently (and the window stayed at its default), then only warned."""
    with pytest.raises(
        CONFIG_ERROR, match=r"`windowsize` is not a field of RANConfig \(did you mean 'window_size'\?\)"
    ):
        make_config(windowsize=8)
    with pytest.raises(
        CONFIG_ERROR, match=r"`cell_pool` is not a field of RANConfig \(did you mean 'cell_pooling'\?\)"
    ):
        make_config(cell_pool="mean")


def test_loading_and_labelling_a_config_does_not_warn(make_config, tmp_path, caplog):
    """What Transformers itself passes (`model_type`, `auto_map`, `num_labels`, ...) is no typo."""
    with caplog.at_level(logging.WARNING):
        make_config().save_pretrained(tmp_path)
        RANConfig.from_pretrained(tmp_path)
        labelled = AutoConfig.from_pretrained(
            tmp_path, num_labels=3, id2label={0: "a", 1: "b", 2: "c"}, finetuning_task="text-classification"
        )
        labelled.save_pretrained(tmp_path)
        AutoConfig.from_pretrained(tmp_path)
    assert "not RAN configuration fields" not in caplog.text


@pytest.mark.parametrize("overrides, message", CONFIG_ERRORS[:4])
def test_saved_config_with_bad_values_fails_to_load(make_config, tmp_path, overrides, message):
    """An edited config.json is validated on load, not only on construction."""
    make_config().save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config_dict = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config_dict, **overrides}))
    with pytest.raises(CONFIG_ERROR, match=message):
        RANConfig.from_pretrained(tmp_path)
