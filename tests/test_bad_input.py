"""Malformed inputs, labels and configurations fail early with a clear ValueError; all-padding rows stay finite."""

import json

import pytest
import torch

from ran_hf import RANConfig, RANForMaskedLM, RANForSequenceClassification, RANForTokenClassification, RANModel

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


# ---- configuration -----------------------------------------------------------------------------------------------

CONFIG_ERRORS = [
    pytest.param({"window_size": 0}, "`window_size` must be >= 1", id="window-size-zero"),
    pytest.param({"window_size": -4}, "`window_size` must be >= 1", id="window-size-negative"),
    pytest.param({"window_size": 2.5}, "`window_size` must be an int", id="window-size-float"),
    pytest.param({"window_size": "8"}, "`window_size` must be an int", id="window-size-string"),
    pytest.param(
        {"min_window_size": 4}, r"`min_window_size` \(4\) must be smaller than `window_size`", id="min-equal"
    ),
    pytest.param(
        {"min_window_size": 9}, r"`min_window_size` \(9\) must be smaller than `window_size`", id="min-larger"
    ),
    pytest.param({"cell_pooling": "avg"}, "`cell_pooling` must be one of", id="unknown-cell-pooling"),
    pytest.param({"token_pooling": "last"}, "`token_pooling` must be one of", id="unknown-token-pooling"),
    pytest.param({"use_rotary": "no"}, "`use_rotary` must be a bool", id="rotary-not-bool"),
    pytest.param({"use_cell_residual": 0}, "`use_cell_residual` must be a bool", id="residual-not-bool"),
    pytest.param({"window_overlap": -1}, "`window_overlap` must be >= 0", id="negative-overlap"),
    pytest.param({"window_overlap": 1.5}, "`window_overlap` must be an int", id="float-overlap"),
    pytest.param(
        {"window_overlap": 4}, r"`window_overlap` \(4\) must be smaller than `window_size`", id="overlap-equal"
    ),
    pytest.param(
        {"window_overlap": 7}, r"`window_overlap` \(7\) must be smaller than `window_size`", id="overlap-larger"
    ),
]


@pytest.mark.parametrize("overrides, message", CONFIG_ERRORS)
def test_config_rejects_ill_defined_windows(make_config, overrides, message):
    """Window and pooling settings that would make the layout ill-defined raise ValueError naming the field."""
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


@pytest.mark.parametrize("overrides, message", CONFIG_ERRORS[:4])
def test_saved_config_with_bad_values_fails_to_load(make_config, tmp_path, overrides, message):
    """An edited config.json is validated on load, not only on construction."""
    make_config().save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config_dict = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config_dict, **overrides}))
    with pytest.raises(ValueError, match=message):
        RANConfig.from_pretrained(tmp_path)


# ---- all-padding rows --------------------------------------------------------------------------------------------

TASKS = {
    "masked-lm": (RANForMaskedLM, {}),
    "single-label": (RANForSequenceClassification, {"num_labels": 3}),
    "multi-label": (RANForSequenceClassification, {"num_labels": 3, "problem_type": "multi_label_classification"}),
    "regression": (RANForSequenceClassification, {"num_labels": 1}),
    "token-classification": (RANForTokenClassification, {"num_labels": 5}),
}

VARIANTS = [
    pytest.param({}, id="default"),
    pytest.param({"is_causal": True}, id="causal"),
    pytest.param({"cell_pooling": "mean"}, id="mean-pooling"),
    pytest.param({"cell_pooling": "max", "window_overlap": 1}, id="max-pooling-overlap"),
    pytest.param({"memory_review": False}, id="no-memory-review"),
]


def padded_batch():
    """Four rows of 13 positions: full, all padding, left-padded, all padding."""
    input_ids = torch.randint(1, 64, (4, 13), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1] = 0
    attention_mask[2, :6] = 0
    attention_mask[3] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    return input_ids, attention_mask


def task_labels(task, input_ids):
    generator = torch.Generator().manual_seed(1)
    batch_size = input_ids.shape[0]
    if task == "masked-lm":
        return input_ids.clone()
    if task == "single-label":
        return torch.randint(0, 3, (batch_size,), generator=generator)
    if task == "multi-label":
        return torch.randint(0, 2, (batch_size, 3), generator=generator).float()
    if task == "regression":
        return torch.randn(batch_size, generator=generator)
    return torch.randint(0, 5, input_ids.shape, generator=generator)


def test_encoder_outputs_are_finite_for_all_padding_rows(make_config):
    """Every encoder output is finite for all-padding rows; their token states and cells are zero."""
    for pooling in ("last", "mean", "max"):
        model = RANModel(make_config(cell_pooling=pooling)).eval()
        input_ids, attention_mask = padded_batch()
        output = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        for name, value in output.items():
            for tensor in value if isinstance(value, tuple) else (value,):
                if tensor.is_floating_point():
                    assert torch.isfinite(tensor).all(), (pooling, name)
        assert torch.all(output.last_hidden_state[1] == 0) and torch.all(output.last_hidden_state[3] == 0)
        assert not output.cells_mask[1].any() and torch.all(output.cells[1] == 0)


def test_a_batch_of_padding_only_gives_finite_outputs(make_config):
    """Even a batch with no real token at all runs and returns finite values."""
    for model_class in (RANModel, RANForMaskedLM, RANForSequenceClassification, RANForTokenClassification):
        model = model_class(make_config()).eval()
        input_ids = torch.zeros(2, 5, dtype=torch.long)
        output = model(input_ids=input_ids, attention_mask=torch.zeros_like(input_ids))
        first = output.last_hidden_state if model_class is RANModel else output.logits
        assert torch.isfinite(first).all(), model_class.__name__


@pytest.mark.parametrize("task", [pytest.param(task, id=task) for task in TASKS])
@pytest.mark.parametrize("variant", VARIANTS)
def test_all_padding_rows_give_finite_loss_and_gradients(make_config, task, variant):
    """All-padding rows keep logits, loss and every gradient finite, and change nothing for the other rows."""
    model_class, overrides = TASKS[task]
    torch.manual_seed(0)
    model = model_class(make_config(**overrides, **variant)).train()
    input_ids, attention_mask = padded_batch()
    labels = task_labels(task, input_ids)

    output = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, output_hidden_states=True)
    assert torch.isfinite(output.logits).all()
    assert all(torch.isfinite(states).all() for states in output.hidden_states)
    assert torch.isfinite(output.loss)
    output.loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            assert torch.isfinite(parameter.grad).all(), f"{name} has a non-finite gradient"

    # The rows with tokens give the same logits and loss without the all-padding rows beside them.
    real_rows = torch.tensor([0, 2])
    alone = model(input_ids=input_ids[real_rows], attention_mask=attention_mask[real_rows], labels=labels[real_rows])
    torch.testing.assert_close(output.logits[real_rows], alone.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(output.loss, alone.loss, rtol=1e-5, atol=1e-6)
