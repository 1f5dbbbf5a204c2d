"""Behaviour every RAN head owes the Transformers API: outputs, losses, training, checkpointing and tied weights.

What Transformers' `ModelTesterMixin` already checks for every head (test_conformance.py: output shapes, hidden
states, tuple outputs, untied save and load) is not repeated here; these are the checks it lacks."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

from ran_hf import RANForCausalLM, RANForMaskedLM, RANForSequenceClassification, RANForTokenClassification, RANModel


BATCH_SIZE, LENGTH = 3, 13

# task -> (model class, config overrides)
TASKS = {
    "masked-lm": (RANForMaskedLM, {}),
    "single-label": (RANForSequenceClassification, {"num_labels": 3}),
    "multi-label": (RANForSequenceClassification, {"num_labels": 3, "problem_type": "multi_label_classification"}),
    "regression": (RANForSequenceClassification, {"num_labels": 1}),
    "token-classification": (RANForTokenClassification, {"num_labels": 5}),
}
TASK_PARAMS = [pytest.param(task, id=task) for task in TASKS]


def batch():
    """Three sequences over several windows: one full, one right-padded, one left-padded."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, 64, (BATCH_SIZE, LENGTH), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    attention_mask[2, :7] = 0
    return input_ids, attention_mask


def make_labels(task, input_ids, attention_mask):
    """Fixed labels of the right shape and dtype for `task`; padding positions are ignored (-100)."""
    generator = torch.Generator().manual_seed(1)
    if task == "masked-lm":
        labels = input_ids.clone()
        labels[:, ::3] = -100
        return labels.masked_fill(attention_mask == 0, -100)
    if task == "single-label":
        return torch.tensor([0, 2, 1])
    if task == "multi-label":
        return torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    if task == "regression":
        return torch.tensor([0.5, -1.0, 2.0])
    labels = torch.randint(0, 5, input_ids.shape, generator=generator)
    return labels.masked_fill(attention_mask == 0, -100)


def make_task(make_config, task, **overrides):
    """A fresh model for `task` (seeded), the batch and its labels."""
    model_class, task_overrides = TASKS[task]
    torch.manual_seed(0)
    model = model_class(make_config(**task_overrides, **overrides))
    input_ids, attention_mask = batch()
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    return model, inputs, make_labels(task, input_ids, attention_mask)


def unused_parameters(model):
    """Parameters the model documents as unused on the test batch: none (every layer's cell update is reached)."""
    return set()


def test_output_shapes_of_the_encoder(make_config):
    """The encoder returns token states, pooled vectors and per-window cells of the documented shapes."""
    config = make_config()
    input_ids, attention_mask = batch()
    output = RANModel(config).eval()(input_ids=input_ids, attention_mask=attention_mask)
    num_windows = 3  # 13 tokens in windows of 4: the 1-token tail joins the third window
    hidden = config.hidden_size
    assert output.last_hidden_state.shape == (BATCH_SIZE, LENGTH, hidden)
    for name in ("pooler_output", "pooled_cell", "last_cell"):
        assert getattr(output, name).shape == (BATCH_SIZE, hidden), name
    assert output.cells.shape == (BATCH_SIZE, num_windows, hidden)
    # 9 tokens: the 1-token tail joins the second window; 6 tokens: the 2-token tail is a window of its own.
    assert output.cells_mask.tolist() == [[True, True, True], [True, True, False], [True, True, False]]
    assert torch.all(output.last_hidden_state[attention_mask == 0] == 0)
    # (The count and shapes of `hidden_states` are the mixin's `test_hidden_states_output`.)
    assert output.hidden_states is None
    states = RANModel(config).eval()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    assert torch.equal(states.hidden_states[-1], states.last_hidden_state)


@pytest.mark.parametrize(
    "task",
    [pytest.param("encoder", id="model")]
    + [pytest.param(task, id=task) for task in ("masked-lm", "single-label", "token-classification")],
)
def test_return_dict_false_in_the_config_returns_tuples(make_config, task):
    """`return_dict=False` in the config returns the output's fields as a plain tuple (the argument is the mixin's
    `test_model_outputs_equivalence`)."""
    overrides = {"return_dict": False}
    if task == "encoder":
        torch.manual_seed(0)
        model = RANModel(make_config(**overrides))
        input_ids, attention_mask = batch()
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    else:
        model, kwargs, labels = make_task(make_config, task, **overrides)
        kwargs["labels"] = labels
    model.eval()
    kwargs["output_hidden_states"] = True
    with torch.no_grad():
        as_tuple = model(**kwargs)
        as_output = model(**kwargs, return_dict=True)
    assert isinstance(as_tuple, tuple)
    expected = as_output.to_tuple()
    assert len(as_tuple) == len(expected)
    for actual, wanted in zip(as_tuple, expected):
        if isinstance(wanted, tuple):
            assert all(torch.equal(a, w) for a, w in zip(actual, wanted, strict=True))
        else:
            assert torch.equal(actual, wanted)


def test_inputs_embeds_match_input_ids(make_config):
    """Feeding the token embeddings gives exactly what feeding the token ids gives: every output of the encoder, its
    cells and their padding mask included (the mixin compares the first output only; the heads add nothing here)."""
    torch.manual_seed(0)
    model = RANModel(make_config()).eval()
    input_ids, attention_mask = batch()
    with torch.no_grad():
        from_ids = model(input_ids=input_ids, attention_mask=attention_mask)
        inputs_embeds = model.get_input_embeddings()(input_ids)
        from_embeds = model(inputs_embeds=inputs_embeds, attention_mask=attention_mask)
    assert from_ids.keys() == from_embeds.keys()
    for name, value in from_ids.items():
        torch.testing.assert_close(from_embeds[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("task", TASK_PARAMS)
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param({}, id="bidirectional"),
        pytest.param({"is_causal": True}, id="causal"),
        pytest.param({"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}, id="dropout"),
        pytest.param({"memory_review": False, "window_overlap": 1, "cell_pooling": "max"}, id="no-review-overlap"),
    ],
)
def test_loss_and_gradients_are_finite(make_config, task, variant):
    """The loss is a finite scalar; backward gives every parameter a finite gradient (bidirectional RAN never reads
    the starting cells of layers after the first, so those alone may get none). A causal masked LM is refused: its
    tokens would read the words before the mask only (the causal LM is the causal task)."""
    if task == "masked-lm" and variant.get("is_causal"):
        with pytest.raises(ValueError, match="RANForMaskedLM fills a mask from the words on both sides"):
            make_task(make_config, task, **variant)
        return
    model, inputs, labels = make_task(make_config, task, **variant)
    model.train()
    loss = model(**inputs, labels=labels).loss
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    unused = unused_parameters(model)
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            assert name in unused, f"{name} got no gradient"
        else:
            assert torch.isfinite(parameter.grad).all(), f"{name} has a non-finite gradient"


def constant_predictor_loss(task, labels):
    """The least loss of a predictor that ignores the tokens: the entropy of the labels (per label column for
    multi-label), or their variance for regression."""
    if task == "regression":
        return labels.var(unbiased=False).item()
    if task == "multi-label":
        share = labels.mean(0)
        return F.binary_cross_entropy(share.expand_as(labels), labels).item()
    counts = torch.bincount(labels[labels != -100]).float()
    share = counts[counts > 0] / counts.sum()
    return -(share * share.log()).sum().item()


@pytest.mark.parametrize("task", TASK_PARAMS)
def test_a_few_adam_steps_reduce_the_loss(make_config, task):
    """The heads fit a tiny fixed batch from its inputs: 60 Adam steps take the loss below half of what the best
    predictor that ignores the inputs reaches (the labels' entropy or variance; initialised, a head scores about that
    or more, near-uniform). A head that learnt the labels' frequencies only, or nothing, stays at or above it."""
    model, inputs, labels = make_task(make_config, task)
    baseline = constant_predictor_loss(task, labels)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] >= baseline - 1e-3, (losses[0], baseline)  # no head starts out knowing the batch
    assert losses[-1] < 0.5 * baseline, (losses, baseline)


def summed_loss(task, logits, labels, attention_mask):
    """Sum of the per-item losses that Transformers divides by `num_items_in_batch`."""
    if task == "single-label":
        return F.cross_entropy(logits, labels, reduction="sum")
    labels = labels.masked_fill(attention_mask == 0, -100)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


@pytest.mark.parametrize(
    "task", [pytest.param(task, id=task) for task in ("masked-lm", "single-label", "token-classification")]
)
@pytest.mark.parametrize("as_tensor", [pytest.param(False, id="int"), pytest.param(True, id="tensor")])
def test_num_items_in_batch_normalises_the_summed_loss(make_config, task, as_tensor):
    """With `num_items_in_batch` the cross-entropy is summed and divided by it, as Transformers' loss functions do."""
    model, inputs, labels = make_task(make_config, task)
    model.eval()
    num_items = 40
    with torch.no_grad():
        mean_output = model(**inputs, labels=labels)
        loss = model(
            **inputs, labels=labels, num_items_in_batch=torch.tensor(num_items) if as_tensor else num_items
        ).loss
    expected = summed_loss(task, mean_output.logits, labels, inputs["attention_mask"]) / num_items
    torch.testing.assert_close(loss, expected)
    assert not torch.isclose(loss, mean_output.loss)


@pytest.mark.parametrize("task", [pytest.param(task, id=task) for task in ("multi-label", "regression")])
def test_num_items_in_batch_is_accepted_where_transformers_ignores_it(make_config, task):
    """Multi-label and regression losses stay means, as in Transformers' sequence classification loss."""
    model, inputs, labels = make_task(make_config, task)
    model.eval()
    with torch.no_grad():
        expected = model(**inputs, labels=labels).loss
        loss = model(**inputs, labels=labels, num_items_in_batch=torch.tensor(40)).loss
    torch.testing.assert_close(loss, expected)


def gradients(model, inputs, labels):
    model.zero_grad()
    model(**inputs, labels=labels).loss.backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}


@pytest.mark.parametrize(
    "task", [pytest.param(task, id=task) for task in ("masked-lm", "single-label", "token-classification")]
)
@pytest.mark.parametrize(
    "use_reentrant", [pytest.param(False, id="non-reentrant"), pytest.param(True, id="reentrant")]
)
def test_gradient_checkpointing_gives_the_same_gradients(make_config, task, use_reentrant):
    """Recomputing the layers in backward (activation checkpointing) leaves every gradient unchanged."""
    model, inputs, labels = make_task(make_config, task)
    model.train()
    projections = []  # one entry per call of a layer's query/key/value projection
    for layer in model.model.layers:
        layer.qkv_proj.register_forward_hook(lambda *_: projections.append(1))
    expected = gradients(model, inputs, labels)
    calls_without_checkpointing = len(projections)

    projections.clear()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert model.is_activation_checkpointing
    actual = gradients(model, inputs, labels)

    assert len(projections) == 2 * calls_without_checkpointing, "backward should run every layer a second time"
    assert actual.keys() == expected.keys()
    for name, gradient in expected.items():
        torch.testing.assert_close(actual[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


def assert_tied(model):
    embeddings = model.get_input_embeddings()
    assert model.get_output_embeddings() is model.decoder
    assert model.decoder.weight is embeddings.weight
    assert model.decoder.weight.data_ptr() == embeddings.weight.data_ptr()


def test_masked_lm_decoder_is_the_embedding_after_init_and_save_load(make_config, tmp_path):
    """The MLM decoder weight is the token embedding itself, before and after a save/load round trip."""
    torch.manual_seed(0)
    model = RANForMaskedLM(make_config())
    assert_tied(model)
    model.save_pretrained(tmp_path)
    for loader in (RANForMaskedLM, AutoModelForMaskedLM):
        reloaded = loader.from_pretrained(tmp_path)
        assert_tied(reloaded)
        assert torch.equal(reloaded.decoder.weight, model.decoder.weight)
        assert torch.equal(reloaded.decoder.bias, model.decoder.bias)


def test_masked_lm_stays_tied_through_training(make_config):
    """An optimiser step moves the decoder and the embedding together: they are one tensor."""
    model, inputs, labels = make_task(make_config, "masked-lm")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = model.decoder.weight.detach().clone()
    model(**inputs, labels=labels).loss.backward()
    optimizer.step()
    assert_tied(model)
    assert not torch.equal(model.decoder.weight, before)


def test_causal_models_default_to_their_own_decoder(make_config, tmp_path):
    """Causal configs default to an untied decoder (tied, a causal RAN merged key digits for good: docs/memory.md);
    the encoder's default stays tied, as the official checkpoints are, and an explicit choice wins either way."""
    assert make_config().tie_word_embeddings is True
    assert make_config(is_causal=True).tie_word_embeddings is False
    assert make_config(is_causal=True, tie_word_embeddings=True).tie_word_embeddings is True
    torch.manual_seed(0)
    model = RANForCausalLM(make_config(is_causal=True))
    assert model.decoder.weight is not model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.tie_word_embeddings is False
    assert reloaded.decoder.weight is not reloaded.get_input_embeddings().weight
    assert torch.equal(reloaded.decoder.weight, model.decoder.weight)
    # A causal checkpoint saved tied (every one saved before the default changed) reloads tied: the config file
    # names the choice, and the decoder has no weight of its own in the checkpoint.
    tied = RANForCausalLM(make_config(is_causal=True, tie_word_embeddings=True))
    assert_tied(tied)
    tied.save_pretrained(tmp_path / "tied")
    assert_tied(AutoModelForCausalLM.from_pretrained(tmp_path / "tied"))


@pytest.mark.parametrize("new_size", [pytest.param(80, id="grow"), pytest.param(48, id="shrink")])
def test_resize_token_embeddings_resizes_the_tied_decoder(make_config, tmp_path, new_size):
    """Resizing the vocabulary resizes the decoder (weight and bias) with it, keeps old rows, and keeps them tied."""
    torch.manual_seed(0)
    model = RANForMaskedLM(make_config()).eval()
    old_embeddings = model.get_input_embeddings().weight.detach().clone()
    old_bias = model.decoder.bias.detach().clone()
    model.resize_token_embeddings(new_size, mean_resizing=False)

    assert model.config.vocab_size == new_size
    assert model.get_input_embeddings().weight.shape == (new_size, model.config.hidden_size)
    assert model.decoder.out_features == new_size and model.decoder.bias.shape == (new_size,)
    assert_tied(model)
    kept = min(new_size, old_embeddings.shape[0])
    assert torch.equal(model.get_input_embeddings().weight[:kept], old_embeddings[:kept])
    assert torch.equal(model.decoder.bias[:kept], old_bias[:kept])

    input_ids = torch.tensor([[1, 2, new_size - 1, 3, 4, 5]])
    labels = input_ids.clone()
    output = model(input_ids=input_ids, labels=labels)
    assert output.logits.shape == (1, 6, new_size)
    assert torch.isfinite(output.loss)

    model.save_pretrained(tmp_path)
    reloaded = RANForMaskedLM.from_pretrained(tmp_path)
    assert reloaded.config.vocab_size == new_size
    assert_tied(reloaded)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=input_ids).logits, output.logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("is_causal", [False, True], ids=["encoder", "causal"])
def test_no_gradient_dwarfs_the_others_at_initialisation(make_config, is_causal):
    """Global-norm clipping scales every gradient by the largest: one parameter with a huge gradient at
    initialisation starves all the others. (A zero starting cell, standardised on reading, did: its gradient and its
    memory-review key's were 1e2-1e7 times the rest, and cross-window retrieval did not train.)"""
    torch.manual_seed(0)
    config = make_config(is_causal=is_causal, num_labels=3)
    model = (RANForCausalLM if is_causal else RANForSequenceClassification)(config)
    input_ids = torch.randint(1, 64, (4, 40), generator=torch.Generator().manual_seed(0))
    labels = input_ids if is_causal else torch.tensor([0, 1, 2, 0])
    model(input_ids, labels=labels).loss.backward()
    norms = {name: parameter.grad.norm() for name, parameter in model.named_parameters() if parameter.grad is not None}
    total = torch.stack(list(norms.values())).norm()
    assert total < 10, max(norms.items(), key=lambda item: item[1])
