"""A built model's architecture cannot drift silently (issue 45, "What this costs users").

A field the weights or modules were built from, edited on the model's config, used to be ignored or half-applied:
`save_pretrained` then wrote a folder that did not load (size mismatch), or loaded as another model (`hidden_act`),
and a causal LM whose `is_causal` was cleared read future tokens. Now the forward pass and `save_pretrained` refuse,
naming the field and the fix. Fields meant to change on a trained model stay editable; a typo'd attribute is
refused; a head never changes the config object it was handed.
"""

import json
import logging

import pytest
import torch

from ran_hf import RANConfig, RANForCausalLM, RANForMaskedLM, RANForPrefixLM, RANForSequenceClassification, RANModel
from ran_hf.configuration_ran import LAYER_DESIGN_FIELDS


TINY = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8}
TINY |= {"window_size": 4, "min_window_size": 2}
# The fix fits the kind of field (issue 53): a width no trained weight fits is built anew, a field some weights' shapes
# follow loads with `ignore_mismatched_sizes=True`, the others load with the field.
FIXES = {
    "hidden_size": r"build a new model from the config \(`RANForMaskedLM\(config\)`\)",
    **dict.fromkeys(
        ("head_dim", "num_attention_heads", "cutoffs", "div_val"),
        r"from_pretrained\(folder, {field}=.*, ignore_mismatched_sizes=True\)",
    ),
    "is_causal": r"(RANModel|RANForMaskedLM)\.from_pretrained\(folder, is_causal=",
}
FIX = r"from_pretrained\(folder, {field}="


def tokens():
    return torch.randint(1, 50, (2, 11), generator=torch.Generator().manual_seed(0))


def causal_lm(**overrides):
    return RANForCausalLM(RANConfig(**{**TINY, "is_causal": True, **overrides})).eval()


def encoder(**overrides):
    return RANForMaskedLM(RANConfig(**{**TINY, **overrides})).eval()


# (model factory, field, new value): every probe case of the issue.
PROBES = [
    pytest.param(encoder, "hidden_size", 32, id="hidden_size"),
    pytest.param(encoder, "num_hidden_layers", 2, id="num_hidden_layers"),
    pytest.param(encoder, "head_dim", 4, id="head_dim"),
    pytest.param(encoder, "num_attention_heads", 4, id="num_attention_heads"),
    pytest.param(encoder, "hidden_act", "gelu", id="hidden_act"),
    pytest.param(lambda: causal_lm(cutoffs=[20, 40], div_val=2), "cutoffs", [10, 40], id="cutoffs"),
    pytest.param(lambda: causal_lm(cutoffs=[20, 40], div_val=2), "div_val", 1, id="div_val"),
    pytest.param(causal_lm, "associative_memory", False, id="associative_memory"),
    pytest.param(causal_lm, "layer_design", "official", id="layer_design"),
    pytest.param(causal_lm, "is_causal", False, id="is_causal-off"),
    pytest.param(encoder, "is_causal", True, id="is_causal-on-encoder"),
    pytest.param(encoder, "memory_review", False, id="memory_review-off"),
    pytest.param(lambda: encoder(memory_review=False), "memory_review", True, id="memory_review-on"),
    pytest.param(causal_lm, "token_shift", False, id="design-field"),
]


@pytest.mark.parametrize("make_model, field, value", PROBES)
def test_an_architecture_field_edited_on_a_built_model_is_refused_when_it_runs(make_model, field, value):
    model = make_model()
    setattr(model.config, field, value)
    message = rf"`{field}` was changed from .* after the model was built.*{FIXES.get(field, FIX).format(field=field)}"
    with pytest.raises(ValueError, match=message):
        model(tokens())


@pytest.mark.parametrize("make_model, field, value", PROBES)
def test_an_architecture_field_edited_on_a_built_model_is_refused_when_it_saves(make_model, field, value, tmp_path):
    model = make_model()
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=rf"`{field}` was changed from"):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_set_back_the_model_runs_and_saves_again(tmp_path):
    model = encoder()
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="`hidden_act`"):
        model(tokens())
    model.config.hidden_act = "silu"
    model(tokens())
    model.save_pretrained(tmp_path)


def test_the_fix_named_in_the_error_loads_the_trained_model_with_the_field(tmp_path):
    model = encoder()
    model.save_pretrained(tmp_path)
    changed = RANForMaskedLM.from_pretrained(tmp_path, hidden_act="gelu").eval()
    assert changed.config.hidden_act == "gelu"
    changed(tokens())  # built with it: runs
    embedding = changed.model.embeddings.word_embeddings.weight
    torch.testing.assert_close(embedding, model.model.embeddings.word_embeddings.weight)


@pytest.mark.parametrize(
    "field, value",
    [
        ("memory_review_cells", 2),
        ("scan_implementation", "reference"),
        ("hidden_dropout_prob", 0.0),
        ("attention_probs_dropout_prob", 0.0),
        ("output_hidden_states", True),
        ("window_size", 5),
        ("use_cache", False),  # no field: Transformers and its integrations attach their own names
    ],
)
def test_fields_meant_for_a_trained_model_stay_editable(field, value, tmp_path):
    model = causal_lm()
    setattr(model.config, field, value)
    model(tokens())
    model.save_pretrained(tmp_path)
    if field in RANConfig.__dataclass_fields__:  # `use_cache` is a generation setting: Transformers moves it
        assert getattr(RANForCausalLM.from_pretrained(tmp_path).config, field) == value


def test_salient_cells_and_labels_stay_editable(tmp_path):
    """Set on a trained model, salient cells change what its last window reads (11 tokens in windows of 4: with one
    recent cell, the first window's comes back only as a salient one) and both edits survive a save."""
    model = causal_lm(memory_review_cells=1)
    with torch.no_grad():
        bounded = model(tokens()).logits
        model.config.memory_salient_cells = 1
        salient = model(tokens()).logits
    assert not torch.allclose(salient[:, 8:], bounded[:, 8:])  # the edit is applied, not ignored
    torch.testing.assert_close(salient[:, :8], bounded[:, :8])  # the first two windows have nothing older to add
    model.save_pretrained(tmp_path / "causal")
    reloaded = RANForCausalLM.from_pretrained(tmp_path / "causal").eval()
    assert reloaded.config.memory_salient_cells == 1
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens()).logits, salient)

    classifier = RANForSequenceClassification(RANConfig(**TINY, num_labels=2)).eval()
    classifier.config.id2label = {0: "no", 1: "yes"}
    classifier.config.label2id = {"no": 0, "yes": 1}
    classifier(tokens())
    classifier.save_pretrained(tmp_path / "classifier")
    labelled = RANForSequenceClassification.from_pretrained(tmp_path / "classifier").config
    assert labelled.id2label == {0: "no", 1: "yes"} and labelled.label2id == {"no": 0, "yes": 1}


def test_resizing_the_embeddings_is_no_drift():
    model = encoder()
    model.resize_token_embeddings(60)
    assert model.config.vocab_size == 60
    model(tokens())


@pytest.mark.parametrize("name", ["windowsize", "WindowSize", "hiddensize", "cell_pool", "memory_review_cell"])
def test_a_typod_attribute_is_refused(name):
    config = RANConfig(**TINY)
    with pytest.raises(ValueError, match=rf"`{name}` is not a field of RANConfig \(did you mean '\w+'\?\)"):
        setattr(config, name, 3)
    assert name not in vars(config)
    with pytest.raises(ValueError, match=rf"`{name}` is not a field of RANConfig"):
        RANConfig(**TINY, **{name: 3})


@pytest.mark.parametrize("head", [RANForCausalLM, RANForPrefixLM])
def test_a_head_never_changes_the_config_it_was_handed(head, caplog):
    config = RANConfig(**TINY, is_causal=head is RANForPrefixLM)
    before = config.to_dict()
    base = RANModel(config)
    with caplog.at_level(logging.WARNING):
        model = head(config)
    assert config.to_dict() == before
    assert model.config is not config and model.config.is_causal is (head is RANForCausalLM)
    assert sum("runs on a copy of the config" in record.getMessage() for record in caplog.records) == 1
    base(tokens())  # the encoder (or causal model) holding the config is unchanged and runs
    model(tokens())


def test_a_head_given_a_config_of_its_mode_uses_it():
    config = RANConfig(**TINY, is_causal=True)
    assert RANForCausalLM(config).config is config


def test_the_copy_follows_the_design_as_a_config_made_causal_would():
    """Fields left to the layer design take the causal design (as before, when they were resolved when read);
    fields set explicitly, and `tie_word_embeddings`, stay."""
    copied = RANForCausalLM(RANConfig(**TINY, review_initial_cell=False)).config
    made = RANConfig(**TINY, is_causal=True, review_initial_cell=False, tie_word_embeddings=True)
    assert {name: getattr(copied, name) for name in made.architecture_fields} == {
        name: getattr(made, name) for name in made.architecture_fields
    }
    # A config loaded from a folder names every design field: the causal copy keeps the encoder's layer.
    loaded = RANConfig.from_dict(RANConfig(**TINY).to_dict())
    assert RANForCausalLM(loaded).config.layer_design == "official"


def test_the_architecture_fields_are_fields():
    fields = RANConfig.__dataclass_fields__
    assert all(name in fields for name in RANConfig.architecture_fields)
    assert {"memory_review_cells", "memory_salient_cells", "scan_implementation"}.isdisjoint(
        RANConfig.architecture_fields
    )


@pytest.mark.parametrize("is_causal", [False, True], ids=["encoder", "causal"])
def test_a_config_json_of_older_code_loads(tmp_path, is_causal):
    """Written before the design was resolved when the config is made (design fields null or absent, keys of older
    Transformers versions) and before the associative memory existed: it loads as it did, its design resolved by
    `is_causal`, with no memory."""
    model_class = RANForCausalLM if is_causal else RANForMaskedLM
    model = model_class(RANConfig(**TINY, is_causal=is_causal, associative_memory=False)).eval()  # (none then)
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    saved = json.loads(config_file.read_text())
    for name in ("layer_design", *LAYER_DESIGN_FIELDS, "associative_memory", "associative_key_conv"):
        saved.pop(name)
    saved |= {"finetuning_task": None, "tokenizer_class": None, "torchscript": False}
    config_file.write_text(json.dumps(saved))
    loaded = model_class.from_pretrained(tmp_path).eval()
    assert loaded.config.layer_design == ("learnable_memory" if is_causal else "official")
    assert not loaded.config.associative_memory and not loaded.config.associative_key_conv
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()).logits, model(tokens()).logits)
    saved["windowsize"] = 4  # a key that misspells a field is named
    config_file.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"`windowsize` is not a field of RANConfig \(did you mean 'window_size'\?\)"):
        model_class.from_pretrained(tmp_path)


def test_a_design_field_set_to_none_follows_the_design_again():
    config = RANConfig(**TINY)
    config.residual_stream = True  # an ablation of the official layer
    config.is_causal = True
    assert config.layer_design == "learnable_memory" and config.token_shift  # left to the design: follows it
    config.is_causal = False
    assert config.residual_stream and not config.token_shift  # set by hand: stays
    config.residual_stream = None
    assert config.residual_stream is False
