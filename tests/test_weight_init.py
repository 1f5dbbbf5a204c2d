"""Every parameter and buffer is set by `_init_weights`, for every head and option: built on the meta device, given
uninitialised memory filled with NaN (so that no tensor passes by luck), then initialised; and a checkpoint missing
weights loads them initialised, not as whatever memory held."""

import pytest
import torch
from ran_testing import tiny_config
from safetensors.torch import load_file, save_file

from ran_hf import (
    RANForCausalLM,
    RANForMaskedLM,
    RANForQuestionAnswering,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
)


CAUSAL = {"is_causal": True}
CASES = [
    pytest.param(RANModel, {}, id="encoder"),
    pytest.param(RANForMaskedLM, {}, id="masked-lm"),
    pytest.param(RANForSequenceClassification, {"num_labels": 3}, id="sequence-classification"),
    pytest.param(RANForTokenClassification, {"num_labels": 3}, id="token-classification"),
    pytest.param(RANForQuestionAnswering, {}, id="question-answering"),
    pytest.param(RANForCausalLM, CAUSAL, id="causal-lm"),
    pytest.param(RANForCausalLM, {**CAUSAL, "associative_memory": True}, id="associative-memory"),
    pytest.param(RANForCausalLM, {**CAUSAL, "cutoffs": [20, 40], "div_val": 2}, id="adaptive-softmax"),
    pytest.param(RANForCausalLM, {**CAUSAL, "layer_design": "official"}, id="causal-official-layer"),
    pytest.param(RANForCausalLM, {**CAUSAL, "memory_review_cells": 2, "memory_salient_cells": 1}, id="salient-cells"),
    pytest.param(RANForMaskedLM, {"memory_review": False, "use_cell_residual": False}, id="no-review-no-residual"),
]


def tensors(model):
    return [(name, tensor) for name, tensor in [*model.named_parameters(), *model.named_buffers()]]


@pytest.mark.parametrize("model_class,fields", CASES)
def test_init_weights_sets_every_tensor(model_class, fields):
    with torch.device("meta"):
        model = model_class(tiny_config(**fields))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for _, tensor in tensors(model):
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    for module in model.modules():  # as a fresh model's modules are: none initialised yet
        module.__dict__.pop("_is_hf_initialized", None)
    model.init_weights()
    left = [name for name, tensor in tensors(model) if tensor.is_floating_point() and torch.isnan(tensor).any()]
    assert left == []


@pytest.mark.parametrize(
    "fields,missing,expected",
    [
        pytest.param(
            {"associative_memory": True}, "model.layers.0.associative_memory.read_scale", 1.0, id="read-scale"
        ),
        pytest.param({"cutoffs": [20, 40], "div_val": 2}, "decoder.biases.1", 0.0, id="cluster-bias"),
    ],
)
def test_a_checkpoint_missing_a_weight_loads_it_initialised(tmp_path, fields, missing, expected):
    model = RANForCausalLM(tiny_config(is_causal=True, **fields))
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights[missing]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = RANForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.get_parameter(missing), torch.full_like(loaded.get_parameter(missing), expected))
