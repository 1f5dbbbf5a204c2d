"""A config field set on a built model takes effect at once or is refused with the fix (issue 53).

Raising `hidden_dropout_prob` on a built model used to change nothing until the model was saved and loaded again,
and a two-label classifier whose `id2label` was given three labels saved a folder that did not load. Now every field
takes effect at once (read on every call, or taken up by the model's modules when it next runs or saves) or, where the
weights or modules were made from it (`RANConfig.architecture_fields`, listed in docs/architecture.md), is refused with
a fix that works for that kind of field; the labels' count is refused only where a classifier's size changes.
"""

import re
from pathlib import Path

import pytest
import torch
from ran_testing import CONFIG_ERROR
from torch import nn

from ran_hf import (
    RANConfig,
    RANForCausalLM,
    RANForMaskedLM,
    RANForPrefixLM,
    RANForQuestionAnswering,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
)


TINY = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8}
TINY |= {"window_size": 4, "min_window_size": 2}
ARCHITECTURE_MD = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def tokens(length: int = 11):
    return torch.randint(1, 50, (2, length), generator=torch.Generator().manual_seed(0))


def classifier(**overrides):
    return RANForSequenceClassification(RANConfig(**{**TINY, **overrides})).eval()


def causal_lm(**overrides):
    return RANForCausalLM(RANConfig(**{**TINY, "is_causal": True, **overrides})).eval()


def encoder(**overrides):
    return RANForMaskedLM(RANConfig(**{**TINY, **overrides})).eval()


def reloaded(model, folder):
    """The model saved and loaded again: what a model built with its config computes."""
    model.save_pretrained(folder)
    return type(model).from_pretrained(folder).train(model.training)


# ---- dropout: taken up at once --------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["hidden_dropout_prob", "attention_probs_dropout_prob"])
@pytest.mark.parametrize("make_model", [classifier, causal_lm], ids=["classifier", "causal-lm"])
def test_a_dropout_rate_set_on_a_built_model_takes_effect_at_once(make_model, field, tmp_path):
    model = make_model().train()
    torch.manual_seed(1)
    before = model(tokens()).logits
    setattr(model.config, field, 0.6)
    torch.manual_seed(1)
    edited = model(tokens()).logits
    assert not torch.allclose(edited, before)  # the new rate drops other units
    again = reloaded(model, tmp_path)
    torch.manual_seed(1)
    torch.testing.assert_close(edited, again(tokens()).logits)  # as a model built with the rate


@pytest.mark.parametrize("make_model", [classifier, causal_lm], ids=["classifier", "causal-lm"])
def test_dropout_set_to_zero_makes_training_as_deterministic_as_inference(make_model):
    model = make_model().train()
    model.config.hidden_dropout_prob = 0.0
    model.config.attention_probs_dropout_prob = 0
    training = model(tokens()).logits
    torch.testing.assert_close(training, model.eval()(tokens()).logits)


HEADS = [
    pytest.param(lambda: classifier(), id="sequence-classification"),
    pytest.param(lambda: RANForTokenClassification(RANConfig(**TINY)).eval(), id="token-classification"),
    pytest.param(lambda: RANForQuestionAnswering(RANConfig(**TINY)).eval(), id="question-answering"),
    pytest.param(lambda: encoder(), id="masked-lm"),
    pytest.param(lambda: RANForPrefixLM(RANConfig(**TINY)).eval(), id="prefix-lm"),
    pytest.param(lambda: RANModel(RANConfig(**TINY)).eval(), id="base-model"),
    pytest.param(
        lambda: causal_lm(cutoffs=[20, 40], div_val=2, associative_memory=True, memory_review_cells=2),
        id="causal-lm-every-option",
    ),
]


@pytest.mark.parametrize("make_model", HEADS)
def test_every_dropout_of_every_head_takes_the_new_rate(make_model):
    model = make_model()
    model.config.hidden_dropout_prob = 0.3
    model.config.attention_probs_dropout_prob = 0.4
    model(tokens())
    rates = {name: module.p for name, module in model.named_modules() if isinstance(module, nn.Dropout)}
    attention = {
        name: module.attention_dropout
        for name, module in model.named_modules()
        if hasattr(module, "attention_dropout")
    }
    assert rates and set(rates.values()) == {0.3}, rates
    assert attention and set(attention.values()) == {0.4}, attention


def test_a_dropout_edit_is_taken_up_when_the_model_saves(tmp_path):
    model = classifier()
    model.config.hidden_dropout_prob = 0.3
    model.save_pretrained(tmp_path)
    assert model.dropout.p == 0.3 and model.model.embeddings.dropout.p == 0.3


def test_lora_dropout_keeps_its_own_rate():
    peft = pytest.importorskip("peft")
    from ran_hf.integrations.lora import ran_lora_config

    model = classifier()
    model = peft.get_peft_model(model, ran_lora_config(model, r=2, lora_dropout=0.05))
    model.config.hidden_dropout_prob = 0.3
    model(input_ids=tokens())
    dropouts = [(name, module.p) for name, module in model.named_modules() if isinstance(module, nn.Dropout)]
    assert {rate for name, rate in dropouts if "lora_dropout" in name} == {0.05}
    assert {rate for name, rate in dropouts if "lora_dropout" not in name} == {0.3}


def test_the_padding_index_follows_pad_token_id(tmp_path):
    model = encoder()
    model.config.pad_token_id = 3
    model(tokens())
    assert model.get_input_embeddings().padding_idx == 3
    assert reloaded(model, tmp_path).get_input_embeddings().padding_idx == 3


# ---- fields read on every call --------------------------------------------------------------------------------------

READ = [
    pytest.param(classifier, "window_size", 5, id="window_size"),
    pytest.param(classifier, "min_window_size", 3, id="min_window_size"),
    pytest.param(classifier, "window_overlap", 2, id="window_overlap"),
    pytest.param(classifier, "cell_pooling", "mean", id="cell_pooling"),
    pytest.param(classifier, "use_rotary", False, id="use_rotary"),
    pytest.param(classifier, "rope_theta", 10.0, id="rope_theta"),
    pytest.param(causal_lm, "window_size", 3, id="causal-window_size"),
    pytest.param(causal_lm, "use_rotary", False, id="causal-use_rotary"),
    pytest.param(causal_lm, "rope_theta", 10.0, id="causal-rope_theta"),
    pytest.param(causal_lm, "memory_review_cells", 1, id="memory_review_cells"),
    pytest.param(lambda: causal_lm(memory_review_cells=1), "memory_salient_cells", 1, id="memory_salient_cells"),
]


def computed(model):
    """Logits of a whole pass, and for a causal model those of a decoding step after a cached prefix."""
    ids = tokens(14)  # windows of 4, 4, 4 and 2: a tail `min_window_size=3` joins to the window before
    with torch.no_grad():
        outputs = [model(ids).logits]
        if model.config.is_causal:
            cache = model(ids[:, :-1], use_cache=True).past_key_values
            outputs.append(model(ids[:, -1:], past_key_values=cache, use_cache=True).logits)
    return outputs


@pytest.mark.parametrize("make_model, field, value", READ)
def test_a_field_read_on_every_call_takes_effect_at_once(make_model, field, value, tmp_path):
    model = make_model()
    for parameter in model.parameters():  # weights far from initialisation, so that every field shows
        parameter.data.normal_(generator=torch.Generator().manual_seed(parameter.numel()), std=0.3)
    before = computed(model)
    setattr(model.config, field, value)
    edited = computed(model)
    assert not torch.allclose(edited[0], before[0]), f"{field} changed nothing"
    if model.config.is_causal:  # the step read the edit as the whole pass did
        torch.testing.assert_close(edited[1], edited[0][:, -1:], rtol=1e-5, atol=1e-5)
    for mine, built in zip(edited, computed(reloaded(model, tmp_path))):
        torch.testing.assert_close(mine, built)


# ---- labels ---------------------------------------------------------------------------------------------------------

LABEL_EDITS = [
    pytest.param({"id2label": {0: "neg", 1: "neu", 2: "pos"}}, 3, id="id2label-of-three"),
    pytest.param({"num_labels": 5}, 5, id="num_labels-5"),
]
LABEL_FIX = r"from_pretrained\(folder, num_labels={n}, ignore_mismatched_sizes=True\)"


@pytest.mark.parametrize("head", [RANForSequenceClassification, RANForTokenClassification])
@pytest.mark.parametrize("edit, count", LABEL_EDITS)
def test_a_classifier_given_another_number_of_labels_is_refused_with_the_fix(head, edit, count, tmp_path):
    model = head(RANConfig(**TINY)).eval()
    for name, value in edit.items():
        setattr(model.config, name, value)
    message = rf"`num_labels` was changed from 2 to {count}.*{head.__name__}\.{LABEL_FIX.format(n=count)}"
    with pytest.raises(ValueError, match=message):
        model(tokens())
    with pytest.raises(ValueError, match=message):
        model.save_pretrained(tmp_path / "edited")
    assert not (tmp_path / "edited" / "config.json").exists()  # no folder that fails to load
    # The fix, as the error words it.
    model.config.num_labels = 2
    model.save_pretrained(tmp_path / "trained")
    grown = head.from_pretrained(tmp_path / "trained", num_labels=count, ignore_mismatched_sizes=True).eval()
    assert grown(tokens()).logits.shape[-1] == count
    torch.testing.assert_close(
        grown.model.embeddings.word_embeddings.weight, model.model.embeddings.word_embeddings.weight
    )
    grown.save_pretrained(tmp_path / "grown")
    assert head.from_pretrained(tmp_path / "grown").config.num_labels == count


@pytest.mark.parametrize(
    "head, labels",
    [
        (RANForSequenceClassification, torch.tensor([0, 2])),
        (RANForTokenClassification, torch.full((2, 11), 2)),
    ],
)
def test_a_labelled_forward_after_the_edit_names_it_before_any_compute(head, labels):
    model = head(RANConfig(**TINY)).eval()
    model.config.num_labels = 3
    ran = []
    model.model.register_forward_pre_hook(lambda *args: ran.append(True))
    with pytest.raises(ValueError, match=r"`num_labels` was changed from 2 to 3"):
        model(tokens(), labels=labels)
    assert ran == []


def test_relabelling_as_many_labels_takes_effect_and_saves(tmp_path):
    model = classifier()
    model.config.id2label = {0: "no", 1: "yes"}
    model(tokens())
    model.save_pretrained(tmp_path)
    assert RANForSequenceClassification.from_pretrained(tmp_path).config.id2label == {0: "no", 1: "yes"}


def test_num_labels_on_a_model_without_a_classifier_is_only_metadata(tmp_path):
    model = encoder()
    model.config.num_labels = 4
    model(tokens())
    assert reloaded(model, tmp_path).config.num_labels == 4


@pytest.mark.parametrize(
    "make",
    [
        lambda: RANConfig(**TINY, num_labels=-2),
        lambda: setattr(RANConfig(**TINY), "num_labels", -2),
        lambda: RANConfig.from_dict(RANConfig(**TINY).to_dict(), num_labels=-2),
    ],
    ids=["made", "set", "from_dict"],
)
def test_a_negative_num_labels_is_named_as_given(make):
    with pytest.raises(ValueError, match=r"`num_labels` must be >= 1, got -2"):
        make()


def test_an_empty_id2label_is_named():
    with pytest.raises(CONFIG_ERROR, match=r"`id2label` names no label"):
        RANConfig(**TINY, id2label={})


@pytest.mark.parametrize(
    "make",
    [
        lambda: RANConfig(**TINY, per_layer_config={0: {"window_size": 3}}),
        lambda: setattr(RANConfig(**TINY), "per_layer_config", {1: {"hidden_act": "gelu"}}),
        lambda: RANConfig.from_dict({**TINY, "per_layer_config": {0: {"window_size": 3}}}),
    ],
    ids=["made", "set", "from_dict"],
)
def test_per_layer_values_are_refused_when_given_not_when_a_layer_reads_them(make):
    """Every RAN layer is built from the config's own fields: a heterogeneous config (Transformers' per-layer values)
    is refused where it is given, naming the field, not by an ambiguous read deep in a forward pass."""
    with pytest.raises(ValueError, match=r"`per_layer_config` is not supported"):
        make()
    config = RANConfig(**TINY)
    config.per_layer_config = None  # none is none
    assert not config.is_heterogeneous and config.to_dict()["window_size"] == TINY["window_size"]


# ---- refused fields: the fix fits the kind of field -----------------------------------------------------------------


def test_hidden_size_advises_a_new_model_not_a_load_that_cannot_work():
    model = encoder()
    model.config.hidden_size = 64
    with pytest.raises(ValueError) as error:
        model(tokens())
    message = str(error.value)
    assert "`hidden_size` was changed from 16 to 64" in message
    assert "RANForMaskedLM(config)" in message and "from_pretrained" not in message
    RANForMaskedLM(model.config)(tokens())  # the fix: a model built from the config


@pytest.mark.parametrize(
    "make_model, field, value",
    [
        pytest.param(encoder, "head_dim", 4, id="head_dim"),
        pytest.param(encoder, "num_attention_heads", 4, id="num_attention_heads"),
        pytest.param(lambda: causal_lm(cutoffs=[20, 40], div_val=2), "cutoffs", [10, 40], id="cutoffs"),
        pytest.param(lambda: causal_lm(cutoffs=[20, 40], div_val=2), "div_val", 1, id="div_val"),
    ],
)
def test_a_field_some_weights_are_shaped_by_advises_ignore_mismatched_sizes(make_model, field, value, tmp_path):
    model = make_model()
    built = getattr(model.config, field)
    setattr(model.config, field, value)
    head = type(model).__name__
    fix = rf"{head}\.from_pretrained\(folder, {field}={re.escape(repr(value))}, ignore_mismatched_sizes=True\)"
    with pytest.raises(ValueError, match=rf"`{field}` was changed.*{fix}.*`{head}\(config\)`"):
        model(tokens())
    setattr(model.config, field, built)  # the fix, as worded: set back, save, load with the field
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, **{field: value}, ignore_mismatched_sizes=True)
    assert getattr(loaded.config, field) == value
    loaded(tokens())


def test_vocab_size_advises_resizing_the_embeddings():
    model = encoder()
    model.config.vocab_size = 60
    with pytest.raises(
        ValueError, match=r"`vocab_size` was changed from 50 to 60.*`model.resize_token_embeddings\(60\)`"
    ):
        model(tokens())
    model.resize_token_embeddings(60)  # the fix
    assert model(tokens()).logits.shape[-1] == 60


@pytest.mark.parametrize(
    "make_model, field, value",
    [
        pytest.param(encoder, "num_hidden_layers", 2, id="num_hidden_layers"),
        pytest.param(encoder, "hidden_act", "gelu", id="hidden_act"),
        pytest.param(encoder, "layer_norm_eps", 1e-5, id="layer_norm_eps"),
        pytest.param(classifier, "token_pooling", "mean", id="token_pooling"),
        pytest.param(encoder, "memory_review", False, id="memory_review"),
        pytest.param(encoder, "use_cell_residual", False, id="use_cell_residual"),
        pytest.param(causal_lm, "associative_memory", False, id="associative_memory"),
        pytest.param(causal_lm, "token_shift", False, id="design-field"),
        pytest.param(causal_lm, "layer_design", "official", id="layer_design"),
        pytest.param(causal_lm, "tie_word_embeddings", True, id="tie_word_embeddings"),
    ],
)
def test_a_field_modules_are_built_from_advises_loading_with_it(make_model, field, value, tmp_path):
    model = make_model()
    built = getattr(model.config, field)
    setattr(model.config, field, value)
    head = type(model).__name__
    fix = rf"{head}\.from_pretrained\(folder, {field}={re.escape(repr(value))}\)"
    with pytest.raises(ValueError, match=rf"`{field}` was changed from {re.escape(repr(built))}.*{fix}"):
        model(tokens())
    setattr(model.config, field, built)  # the fix, as worded
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, **{field: value}).eval()
    assert getattr(loaded.config, field) == value
    loaded(tokens())


def test_is_causal_on_a_head_of_one_mode_names_the_heads_of_the_other():
    model = causal_lm()
    model.config.is_causal = False
    with pytest.raises(ValueError, match=r"RANForCausalLM always runs causal.*RANModel\.from_pretrained"):
        model(tokens())


def test_is_encoder_decoder_is_refused():
    with pytest.raises(CONFIG_ERROR, match=r"`is_encoder_decoder=True`.*RANForPrefixLM"):
        RANConfig(**TINY, is_encoder_decoder=True)
    model = causal_lm()
    model.config.is_encoder_decoder = True
    with pytest.raises(ValueError, match=r"`is_encoder_decoder=True`"):
        model(tokens())


# ---- one rule per field, listed in the docs -------------------------------------------------------------------------


def test_the_refused_fields_are_fields():
    assert set(RANConfig.architecture_fields) <= set(RANConfig.__dataclass_fields__)


def documented_fields() -> list[str]:
    """The fields docs/architecture.md lists as refused on a built model."""
    section = ARCHITECTURE_MD.read_text().split("**What a field set on a built model does.**", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| **architecture_fields**"))
    return re.findall(r"`([a-z_0-9]+)`", row)


def test_the_docs_list_the_refused_fields():
    assert documented_fields() == list(RANConfig.architecture_fields)


def test_the_configuration_page_describes_every_field():
    from ran_hf.configuration_ran import RAN_FIELDS

    page = (ARCHITECTURE_MD.parent / "configuration.md").read_text()
    described = set(re.findall(r"^\| `([a-z_0-9]+)`", page, flags=re.MULTILINE)) | {"bos_token_id", "eos_token_id"}
    assert described == set(RAN_FIELDS)
