"""Accelerate's offloading, as `from_pretrained(..., device_map="auto")` uses it where the weights do not fit: every
head gives the plain model's outputs and `generate()` its tokens, with Accelerate's own hooks, beside Llama.

Accelerate keeps offloaded weights on the `meta` device and moves each module's in just before its call, through a
hook that replaces the module's `forward`: a path that reads a weight past its module's call reads `meta`.
"""

import copy

import pytest
import torch
from accelerate import cpu_offload, disk_offload
from ran_testing import randomize_, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM

from ran_hf import (
    RANForCausalLM,
    RANForMaskedLM,
    RANForPrefixLM,
    RANForQuestionAnswering,
    RANForSequenceClassification,
    RANForTokenClassification,
)


TOLERANCE = 1e-5  # offloaded, a layer's wrapped modules run the reference scan, not the fused one (same maths)
IDS = torch.randint(1, 61, (2, 17), generator=torch.Generator().manual_seed(0))


def llama():
    config = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    return LlamaForCausalLM(config).eval()


MODELS = {
    "classifier": lambda: RANForSequenceClassification(tiny_config(num_labels=3)),
    "masked-lm": lambda: RANForMaskedLM(tiny_config()),
    "token-classifier": lambda: RANForTokenClassification(tiny_config(num_labels=4)),
    "question-answering": lambda: RANForQuestionAnswering(tiny_config()),
    "prefix-lm": lambda: RANForPrefixLM(tiny_config()),
    "causal-lm": lambda: RANForCausalLM(tiny_config(is_causal=True)),
    "causal-lm-official": lambda: RANForCausalLM(tiny_config(is_causal=True, layer_design="official")),
    "causal-lm-overlap-token-shift": lambda: RANForCausalLM(
        tiny_config(is_causal=True, window_overlap=2, token_shift=True)
    ),
    "causal-lm-salient-cells": lambda: RANForCausalLM(
        tiny_config(is_causal=True, memory_review_cells=1, memory_salient_cells=1)
    ),
    "causal-lm-associative-memory": lambda: RANForCausalLM(tiny_config(is_causal=True, associative_memory=True)),
    "llama": llama,
}


def offloaded(model, how: str, tmp_path):
    model = copy.deepcopy(model)
    if how == "cpu_offload":
        return cpu_offload(model, execution_device="cpu")
    return disk_offload(model, str(tmp_path), execution_device="cpu")


def outputs(model) -> list[torch.Tensor]:
    kwargs = (
        {"token_type_ids": (torch.arange(17) >= 9).long().expand(2, -1)} if isinstance(model, RANForPrefixLM) else {}
    )
    with torch.no_grad():
        result = model(IDS, **kwargs)
    if "start_logits" in result:
        return [result.start_logits, result.end_logits]
    return [result.logits]


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload"])
@pytest.mark.parametrize("name", list(MODELS))
def test_an_offloaded_model_gives_the_plain_models_outputs_and_tokens(name, how, tmp_path):
    torch.manual_seed(0)
    model = MODELS[name]()
    if name != "llama":
        randomize_(model)
    moved = offloaded(model, how, tmp_path)
    for plain, offload in zip(outputs(model), outputs(moved)):
        assert (plain - offload).abs().max() <= TOLERANCE
    if name.startswith(("causal", "llama")):
        kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(model.generate(IDS[:, :5], **kwargs), moved.generate(IDS[:, :5], **kwargs))


@pytest.mark.parametrize("name", ["classifier", "causal-lm", "llama"])
def test_from_pretrained_with_a_device_map_that_offloads_to_disk(name, tmp_path):
    """What `device_map="auto"` does where the weights do not fit: here, every layer on the disk."""
    torch.manual_seed(0)
    model = MODELS[name]()
    if name != "llama":
        randomize_(model)
    model.save_pretrained(tmp_path / "saved")
    if name == "llama":
        device_map = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu",
                      "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip
    else:  # every module on the CPU but the layers
        device_map = {f"model.{child}": "cpu" for child, _ in model.model.named_children() if child != "layers"}
        device_map |= {child: "cpu" for child, _ in model.named_children() if child != "model"}
        device_map["model.layers"] = "disk"
    loaded = (
        type(model)
        .from_pretrained(tmp_path / "saved", device_map=device_map, offload_folder=str(tmp_path / "offload"))
        .eval()
    )
    assert any(parameter.device.type == "meta" for parameter in loaded.parameters())  # really offloaded
    for plain, offload in zip(outputs(model), outputs(loaded)):
        assert (plain - offload).abs().max() <= TOLERANCE
    if name != "classifier":
        kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(model.generate(IDS[:, :5], **kwargs), loaded.generate(IDS[:, :5], **kwargs))
