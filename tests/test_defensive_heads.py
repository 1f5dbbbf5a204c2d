"""The newer heads and options as defensive as the core: the prefix LM, question answering, the starting cell, the
cache (one transaction per forward, the hint to detach it), the adaptive softmax, label fields, `--config_overrides`
strings, model sizes and the ONNX export of the prefix LM. Each case gave a silent wrong result or a raw library
error before."""

import copy
import inspect
import math

import pytest
import torch
from argument_checks import apply_config_overrides
from ran_testing import CONFIG_ERROR, pad_batch, random_ids, randomize_, tiny_config
from transformers import BertTokenizerFast

from ran_hf import (
    RANCache,
    RANConfig,
    RANForCausalLM,
    RANForMaskedLM,
    RANForPrefixLM,
    RANForQuestionAnswering,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
    prefix_lm_features,
)
from ran_hf.input_checks import InputChecks
from ran_hf.modeling_ran import head_outputs


FLOAT32_MAX = torch.finfo(torch.float32).max


# ---- prefix LM ------------------------------------------------------------------------------------------------------


def test_prefix_lm_labels_without_token_type_ids_are_refused():
    """Without `token_type_ids` the whole text is source and nothing is scored: the loss was 0.0."""
    model = RANForPrefixLM(tiny_config())
    input_ids = torch.randint(1, 61, (2, 9))
    with pytest.raises(ValueError, match="`labels` .* `token_type_ids`.*prefix_lm_features"):
        model(input_ids, labels=input_ids)


def test_prefix_lm_mask_of_the_wrong_shape_is_named():
    model = RANForPrefixLM(tiny_config())
    input_ids = torch.randint(1, 61, (2, 9))
    types = torch.tensor([[0] * 5 + [1] * 4] * 2)
    with pytest.raises(ValueError, match=r"`attention_mask` must have the inputs' shape \(2, 9\).*got \(2, 8\)"):
        model(input_ids, attention_mask=torch.ones(2, 8, dtype=torch.long), token_type_ids=types)


@pytest.fixture(scope="module")
def wordpiece():
    """A WordPiece tokenizer of 16 ids: [PAD] = 0, the letters a to k."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijk"]
    return BertTokenizerFast(vocab={word: index for index, word in enumerate(words)})


@pytest.mark.parametrize("max_target_length", [0, -1, 2.5])
def test_prefix_lm_features_refuse_a_target_length_that_holds_no_end_of_text(wordpiece, max_target_length):
    """`max_target_length=0` kept 3 of 4 target tokens (a `[:-1]` slice)."""
    with pytest.raises(ValueError, match=r"`max_target_length` .* >= 1"):
        prefix_lm_features(wordpiece, "a b", "c d e f", max_target_length=max_target_length)


@pytest.mark.parametrize("max_target_length, kept", [(None, 4), (5, 4), (3, 2), (1, 0)])
def test_prefix_lm_features_keep_max_target_length_tokens_with_the_end_of_text(wordpiece, max_target_length, kept):
    features = prefix_lm_features(wordpiece, "a b", "c d e f", max_target_length=max_target_length)
    target = [token for token, kind in zip(features["input_ids"], features["token_type_ids"]) if kind == 1]
    assert target == wordpiece.convert_tokens_to_ids(["c", "d", "e", "f"][:kept]) + [wordpiece.sep_token_id]


def test_prefix_lm_features_refuse_a_source_length_below_one(wordpiece):
    with pytest.raises(ValueError, match=r"`max_source_length` .* >= 1"):
        prefix_lm_features(wordpiece, "a b", "c", max_source_length=0)


# ---- question answering ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qa_model():
    return randomize_(RANForQuestionAnswering(tiny_config()))


def qa_batch():
    """Two texts, 13 and 7 tokens, right-padded to 13."""
    return pad_batch([random_ids(13, 61, 0), random_ids(7, 61, 1)])


@pytest.mark.parametrize(
    "starts, ends",
    [
        pytest.param([13, 13], [13, 13], id="one past the end"),
        pytest.param([50, 900], [60, 901], id="far past the end"),
        pytest.param([13, 9], [13, 10], id="past the end and on padding"),
    ],
)
def test_a_batch_whose_answers_are_all_ignored_has_zero_loss_and_gradients(qa_model, starts, ends):
    """Transformers' convention ignores an answer at or past the end (here: on padding too); a batch of only those
    gave NaN."""
    input_ids, attention_mask = qa_batch()
    model = copy.deepcopy(qa_model).train()
    positions = {"start_positions": torch.tensor(starts), "end_positions": torch.tensor(ends)}
    loss = model(input_ids, attention_mask=attention_mask, **positions).loss
    assert loss.item() == 0.0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_ignored_answers_leave_the_others_loss_as_it_was(qa_model):
    input_ids, attention_mask = qa_batch()
    with torch.no_grad():
        alone = qa_model(input_ids[:1], start_positions=torch.tensor([3]), end_positions=torch.tensor([4])).loss
        both = qa_model(
            input_ids, attention_mask=attention_mask, start_positions=torch.tensor([3, 13]),
            end_positions=torch.tensor([4, 200]),
        ).loss  # fmt: skip
    torch.testing.assert_close(both, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "starts, ends, message",
    [
        pytest.param(
            [5, 2],
            [3, 4],
            r"example 0 starts after it ends: `start_positions` \(5\) after `end_positions` \(3\)",
            id="reversed",
        ),
        pytest.param([-1, 2], [3, 4], r"`start_positions` holds -1 \(example 0\).*negative", id="negative start"),
        pytest.param([1, 2], [3, -100], r"`end_positions` holds -100 \(example 1\)", id="negative end"),
        pytest.param([1, 2], [3, 9], r"example 1 .*`end_positions` \(9\) is not", id="half on padding"),
        pytest.param([13, 2], [3, 4], r"example 0 .*`start_positions` \(13\) is not", id="half past the end"),
    ],
)
def test_answers_outside_the_convention_are_named(qa_model, starts, ends, message):
    input_ids, attention_mask = qa_batch()
    with pytest.raises(ValueError, match=message):
        qa_model(
            input_ids, attention_mask=attention_mask, start_positions=torch.tensor(starts),
            end_positions=torch.tensor(ends),
        )  # fmt: skip


def test_answer_positions_as_python_lists_are_named(qa_model):
    """Transformers' span loss takes tensors only (`.size()` of a list: AttributeError)."""
    with pytest.raises(ValueError, match=r"`start_positions` must be a tensor .*torch.tensor\(\[1, 2\]\).*list"):
        qa_model(torch.randint(1, 61, (2, 9)), start_positions=[1, 2], end_positions=[3, 4])


# ---- labels: every head checks its own, before its base model runs ------------------------------------------------


def token_labels(value: int, **inputs) -> dict:
    labels = torch.full((2, 9), -100)
    labels[1, 4] = value
    return {"labels": labels, **inputs}


TYPES = torch.tensor([[0] * 5 + [1] * 4] * 2)  # a prefix LM's source, then its target

# head, config fields, good labels, bad labels, the bad one's error
LABELLED_HEADS = [
    pytest.param(
        RANForMaskedLM,
        {},
        token_labels(60),
        token_labels(61),
        r"`labels` holds a token id outside \[0, 60\]",
        id="masked-lm",
    ),
    pytest.param(
        RANForCausalLM,
        {},
        token_labels(0),
        token_labels(-3),
        r"`labels` holds a token id outside \[0, 60\]",
        id="causal-lm",
    ),
    pytest.param(
        RANForPrefixLM,
        {},
        token_labels(60, token_type_ids=TYPES),
        token_labels(70, token_type_ids=TYPES),
        r"`labels` holds a token id outside \[0, 60\]",
        id="prefix-lm",
    ),
    pytest.param(
        RANForTokenClassification,
        {"num_labels": 2},
        token_labels(1),
        token_labels(2),
        r"`labels` holds a class id outside \[0, 1\]",
        id="token-classification",
    ),
    pytest.param(
        RANForSequenceClassification,
        {"num_labels": 3},
        {"labels": torch.tensor([0, 2])},
        {"labels": torch.tensor([0, 3])},
        r"`labels` holds a class outside \[0, 2\]",
        id="sequence-classification",
    ),
    pytest.param(
        RANForQuestionAnswering,
        {},
        {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([2, 3])},
        {"start_positions": torch.tensor([1, -1]), "end_positions": torch.tensor([2, 3])},
        r"`start_positions` holds -1 \(example 1\)",
        id="question-answering",
    ),
]


@pytest.mark.parametrize("head, fields, good, bad, message", LABELLED_HEADS)
def test_a_bad_label_is_named_before_the_base_model_runs(head, fields, good, bad, message):
    """The head reads its labels' checks itself: the base model (and its host read) never starts on a bad label."""
    model = head(tiny_config(**fields)).eval()
    started = []
    model.model.register_forward_pre_hook(lambda *_: started.append(True))
    with pytest.raises(ValueError, match=message):
        model(torch.randint(1, 61, (2, 9)), **bad)
    assert not started


@pytest.mark.parametrize("head, fields, good, bad, message", LABELLED_HEADS)
def test_a_head_reads_its_labels_once_then_runs_the_base_model(head, fields, good, bad, message, monkeypatch):
    """One read of all the labels' conditions (`InputChecks.read_and_judge`), before the base model; the base model
    reads its own inputs' checks, not the labels'."""
    events = []
    read_and_judge = InputChecks.read_and_judge

    def read_labels(checks):
        events.append("labels")
        read_and_judge(checks)

    monkeypatch.setattr(InputChecks, "read_and_judge", read_labels)
    model = head(tiny_config(**fields)).eval()
    model.model.register_forward_pre_hook(lambda *_: events.append("base model"))
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(1, 61, (2, 9)), **good).loss)
    assert events == ["labels", "base model"]


def test_the_base_model_takes_no_label_checks():
    """No side channel for a head's labels through the base model: it neither names nor reads `label_checks`."""
    assert "label_checks" not in inspect.signature(RANModel.forward).parameters
    assert "label_checks" not in inspect.signature(head_outputs).parameters

    def judge(found):
        raise AssertionError("the base model read a head's label checks")

    model = RANModel(tiny_config()).eval()
    with torch.no_grad():
        model(torch.randint(1, 61, (2, 9)), label_checks=InputChecks(torch.ones(1, dtype=torch.long), judge))


@pytest.mark.parametrize("name", ["input_ids", "attention_mask"])
def test_inputs_given_as_python_lists_are_named(name):
    inputs = {"input_ids": torch.randint(1, 61, (2, 9)), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    inputs[name] = inputs[name].tolist()
    with pytest.raises(ValueError, match=rf"`{name}` must be a tensor.*got list.*return_tensors"):
        RANModel(tiny_config())(**inputs)


# ---- float inputs: one check ----------------------------------------------------------------------------------------


def float_bound(hidden_size: int) -> float:
    return math.sqrt(FLOAT32_MAX / hidden_size)


@pytest.mark.parametrize("value", [3e38, -1e20, float("inf"), float("nan")])
def test_a_starting_cell_too_large_to_normalise_is_named(value):
    model = RANModel(tiny_config())
    cell = torch.zeros(2, 16)
    cell[1, 3] = value
    message = "NaN or infinite" if not math.isfinite(value) else r"`initial_cell` holds a value of magnitude 1e\+20"
    if math.isfinite(value) and abs(value) > 1e30:
        message = r"`initial_cell` holds a value of magnitude 3e\+38"
    with pytest.raises(ValueError, match=message):
        model(torch.randint(1, 61, (2, 9)), initial_cell=cell)


def test_inputs_embeds_too_large_to_normalise_are_named():
    model = RANModel(tiny_config())
    embeds = torch.zeros(2, 9, 16)
    embeds[0, 4, 2] = 3e38
    with pytest.raises(ValueError, match=r"`inputs_embeds` holds a value of magnitude 3e\+38.*hidden_size=16"):
        model(inputs_embeds=embeds)


@pytest.mark.parametrize("value", [float("-inf"), float("nan")])
def test_half_precision_inputs_are_checked_in_float32(value):
    """Compared in float16, the bound itself rounds to infinity and -inf would pass."""
    model = RANModel(tiny_config()).to(torch.bfloat16)
    embeds = torch.zeros(2, 9, 16, dtype=torch.float16)
    embeds[1, 0, 0] = value
    with pytest.raises(ValueError, match="`inputs_embeds` holds NaN or infinite values"):
        model(inputs_embeds=embeds.to(torch.bfloat16))
    with pytest.raises(ValueError, match="`initial_cell` holds NaN or infinite values"):
        model(torch.randint(1, 61, (2, 9)), initial_cell=embeds[:, 0])


def test_a_compiled_model_asserts_the_same_bound():
    torch._dynamo.reset()
    compiled = torch.compile(RANModel(tiny_config()).eval(), backend="eager")
    with torch.no_grad(), pytest.raises(RuntimeError, match="`initial_cell` holds NaN, infinite values or values of"):
        compiled(torch.randint(1, 61, (2, 9)), initial_cell=torch.full((2, 16), 3e38))
    torch._dynamo.reset()


def test_float_inputs_up_to_the_bound_give_finite_outputs():
    model = randomize_(RANModel(tiny_config()))
    bound = float_bound(16) * 0.999
    signs = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(0)).sign()
    with torch.no_grad():
        outputs = model(inputs_embeds=signs * bound, initial_cell=signs[:, 0] * bound)
    assert torch.isfinite(outputs.last_hidden_state).all() and torch.isfinite(outputs.last_cell).all()


# ---- the cache: one transaction per forward, batch size, reuse, detach ---------------------------------------------


def causal_model(**overrides):
    return randomize_(RANForCausalLM(tiny_config(is_causal=True, **overrides)))


def layer_state(cache: RANCache) -> list:
    return [{name: tensor.clone() for name, tensor in layer.tensors().items()} for layer in cache.layers] + [
        cache.lengths.clone(),
        cache.seen_positions,
    ]


def assert_same_state(state, cache):
    now = layer_state(cache)
    assert len(now) == len(state)
    for before, after in zip(state[:-2], now[:-2]):
        assert before.keys() == after.keys()
        assert all(torch.equal(before[name], after[name]) for name in before)
    assert torch.equal(state[-2], now[-2]) and state[-1] == now[-1]


@pytest.mark.parametrize("overrides", [{}, {"associative_memory": True}, {"memory_review_cells": 2}], ids=str)
def test_a_forward_that_fails_leaves_the_cache_as_it_was(overrides, monkeypatch):
    model = causal_model(**overrides)
    ids = torch.randint(1, 61, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids).logits
        cache = model(ids[:, :11], use_cache=True).past_key_values
        before = layer_state(cache)
        last_layer = model.model.layers[-1]
        with monkeypatch.context() as patch:
            patch.setattr(last_layer, "forward", lambda *args, **kwargs: (_ for _ in ()).throw(IndexError("fault")))
            with pytest.raises(IndexError, match="fault"):
                model(ids[:, 11:], past_key_values=cache, use_cache=True)
        assert_same_state(before, cache)  # the first layer had updated it
        retried = model(ids[:, 11:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(retried, whole[:, 11:], rtol=1e-5, atol=1e-5)


def test_a_failed_loss_leaves_the_cache_as_it_was():
    """The head's part of the forward belongs to the transaction too (here: labels refused after the layers)."""
    model = causal_model(cutoffs=[20, 40], div_val=2)
    ids = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True).past_key_values
        before = layer_state(cache)
        with pytest.raises(ValueError, match="num_items_in_batch"):
            model(ids[:, 6:], labels=ids[:, 6:], past_key_values=cache, use_cache=True, num_items_in_batch=0)
    assert_same_state(before, cache)


def test_a_cache_continued_with_another_batch_size_is_named():
    model = causal_model()
    with torch.no_grad():
        cache = model(torch.randint(1, 61, (2, 7)), use_cache=True).past_key_values
        with pytest.raises(
            ValueError, match=r"`past_key_values` holds 2 sequences.*inputs have 3.*None.*copy.deepcopy"
        ):
            model(torch.randint(1, 61, (3, 4)), past_key_values=cache, use_cache=True)


def test_chunked_training_without_detaching_the_cache_fails_at_the_backward():
    """The second chunk's backward would run into the first chunk's freed graph: PyTorch's own error, at that
    backward ("backward through the graph a second time"), never a silent gradient; detached (truncated
    backpropagation through time) or kept with `retain_graph=True`, chunked training goes on."""
    model = causal_model().train()
    ids = torch.randint(1, 61, (2, 20), generator=torch.Generator().manual_seed(0))
    first = model(ids[:, :10], labels=ids[:, :10], use_cache=True)
    first.loss.backward()
    second = model(ids[:, 10:], labels=ids[:, 10:], past_key_values=first.past_key_values, use_cache=True)
    with pytest.raises(RuntimeError, match=r"backward through the graph a second time"):
        second.loss.backward()
    first = model(ids[:, :10], labels=ids[:, :10], use_cache=True)
    first.loss.backward()
    second = model(ids[:, 10:], labels=ids[:, 10:], past_key_values=first.past_key_values.detach(), use_cache=True)
    second.loss.backward()
    first = model(ids[:, :10], labels=ids[:, :10], use_cache=True)
    first.loss.backward(retain_graph=True)
    model(ids[:, 10:], labels=ids[:, 10:], past_key_values=first.past_key_values, use_cache=True).loss.backward()


# ---- adaptive softmax -----------------------------------------------------------------------------------------------


def adaptive_model():
    return RANForCausalLM(tiny_config(is_causal=True, cutoffs=[20, 40], div_val=2))


@pytest.mark.parametrize("count", [0, torch.tensor(0), -3])
def test_num_items_in_batch_of_zero_is_named(count):
    model = adaptive_model()
    ids = torch.randint(1, 61, (2, 9))
    with pytest.raises(ValueError, match=r"`num_items_in_batch` .* must be >= 1"):
        model(ids, labels=ids, num_items_in_batch=count)


@pytest.mark.parametrize("head", [RANForCausalLM, RANForPrefixLM, RANForTokenClassification])
def test_num_items_in_batch_of_zero_is_named_for_every_token_head(head):
    """Read where it costs no synchronisation: a number, or a tensor on the CPU."""
    model = head(tiny_config(is_causal=head is RANForCausalLM))
    ids = torch.randint(1, 61, (2, 9))
    types = torch.tensor([[0] * 4 + [1] * 5] * 2) if head is RANForPrefixLM else None
    labels = ids % 2 if head is RANForTokenClassification else ids
    extra = {"token_type_ids": types} if types is not None else {}
    with pytest.raises(ValueError, match=r"`num_items_in_batch` .* must be >= 1, got 0"):
        model(ids, labels=labels, num_items_in_batch=torch.tensor(0), **extra)


def test_resizing_an_adaptive_vocabulary_is_named():
    with pytest.raises(NotImplementedError, match=r"`cutoffs=\[20, 40\]`.*resize_token_embeddings"):
        adaptive_model().resize_token_embeddings(70)


# ---- label fields, config overrides, sizes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_labels": 0}, r"`num_labels` must be >= 1, got 0"),
        ({"problem_type": "foo"}, r"`problem_type` must be one of .*single_label_classification.*got 'foo'"),
    ],
)
@pytest.mark.parametrize("head", [None, RANForSequenceClassification, RANForTokenClassification])
def test_label_fields_are_named(overrides, message, head):
    with pytest.raises(CONFIG_ERROR, match=message):
        config = tiny_config(**overrides)
        if head is not None:
            head(config)


def test_label_fields_set_on_a_config_are_named_when_a_head_is_built():
    config = tiny_config()
    config.problem_type = "foo"
    with pytest.raises(CONFIG_ERROR, match="`problem_type`"):
        RANForSequenceClassification(config)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ("cutoffs=[20,40],div_val=2,is_causal=true", {"cutoffs": [20, 40], "div_val": 2, "is_causal": True}),
        ("is_causal=true,cutoffs=20;40", {"cutoffs": [20, 40]}),
        ("memory_review_cells=3,is_causal=true,layer_design=official", {"memory_review_cells": 3}),
        ("hidden_dropout_prob=0.25,hidden_act=gelu", {"hidden_dropout_prob": 0.25, "hidden_act": "gelu"}),
        ("residual_stream=false,cutoffs=none", {"residual_stream": False, "cutoffs": None}),
    ],
)
def test_config_overrides_parse_every_field(overrides, expected):
    config = tiny_config()
    apply_config_overrides(config, overrides)
    for name, value in expected.items():
        assert getattr(config, name) == value
    RANConfig(**config.to_dict())  # and validate


@pytest.mark.parametrize(
    "overrides, message",
    [
        ("window_size=abc", r"Field 'window_size' expected int, got str \(value: 'abc'\)"),
        ("hidden_dropout_prob=x", r"Field 'hidden_dropout_prob' with value 'x'"),
        ("use_rotary=maybe", r"Field 'use_rotary' expected bool, got str \(value: 'maybe'\)"),
        ("cutoffs=[20,x]", r"Field 'cutoffs' with value '\[20,x\]'"),
        ("windowsize=8", r"`windowsize` is not a field of RANConfig \(did you mean 'window_size'\?\)"),
        ("window_size", r"`window_size` .* `name=value`"),
    ],
)
def test_bad_config_overrides_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        apply_config_overrides(tiny_config(), overrides)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ("window_size=abc", r"Field 'window_size' expected int, got str \(value: 'abc'\)"),
        ("cutoffs=[10,12],div_val=2", {"cutoffs": [10, 12], "div_val": 2}),
        ("cutoffs=10;12", {"cutoffs": [10, 12]}),
    ],
)
def test_the_scripts_config_overrides(wordpiece, overrides, expected):
    """`--config_overrides` as the training scripts read it (`training_utils.load_config`), for a causal LM."""
    from training_utils import ModelArguments, load_config

    arguments = ModelArguments(tokenizer_name="unused", config_overrides=overrides)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            load_config(arguments, wordpiece, is_causal=True)
        return
    config = load_config(arguments, wordpiece, is_causal=True)
    assert {name: getattr(config, name) for name in expected} == expected


def test_overrides_that_make_an_invalid_config_change_nothing():
    config = tiny_config()
    with pytest.raises(ValueError, match="`min_window_size`"):
        apply_config_overrides(config, "hidden_size=32,min_window_size=9")
    assert (config.hidden_size, config.min_window_size) == (16, 2)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"num_hidden_layers": 10**6}, "num_hidden_layers"),
        ({"vocab_size": 10**11}, "vocab_size"),
        ({"num_attention_heads": 10**8}, "num_attention_heads"),
        ({"hidden_size": 10**7}, "hidden_size"),
    ],
)
def test_absurd_sizes_are_refused_at_config_time(overrides, field):
    with pytest.raises(CONFIG_ERROR, match=rf"about [\d.]+e\+\d+ parameters.*{field}.*RANConfig.max_parameters"):
        RANConfig(**overrides)


def test_the_size_bound_can_be_raised(monkeypatch):
    monkeypatch.setattr(RANConfig, "max_parameters", 10**15)
    assert RANConfig(num_hidden_layers=10**6).num_hidden_layers == 10**6


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"is_causal": True},
        {"associative_memory": True, "is_causal": True},
        {"cutoffs": [20, 40], "div_val": 2, "is_causal": True},
        {"num_hidden_layers": 3, "head_dim": 4, "num_attention_heads": 5},
    ],  # fmt: skip
    ids=str,
)
def test_the_parameter_estimate_is_close(overrides):
    config = tiny_config(**overrides)
    actual = sum(parameter.numel() for parameter in RANModel(config).parameters())
    assert abs(config.estimated_parameters() - actual) <= 0.1 * actual


# ---- ONNX -----------------------------------------------------------------------------------------------------------


def test_exporting_a_prefix_lm_is_refused_at_once():
    from ran_hf import export_onnx

    with pytest.raises(NotImplementedError, match="RANForPrefixLM.*token_type_ids"):
        export_onnx(RANForPrefixLM(tiny_config()))
