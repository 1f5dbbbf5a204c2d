"""What a GPU would launch, counted on the meta device (scripts/benchmarks/benchmark_kernels.py): the Triton scan is
four kernels per window and layer plus three per scan, and a training forward of a token head reads the device once
(the window layout's sizes, its inputs' checks and its labels' range together)."""

import pytest
import torch

from benchmark_kernels import KernelCounter, layouts_built_with_values
from ran_hf import RANForCausalLM, RANForMaskedLM, RANForTokenClassification, triton_norm, triton_rotary
from ran_hf.triton_scan import TRITON_AVAILABLE
from ran_testing import tiny_config


def count_training_step(model_class, labels_max, **config_fields):
    with torch.device("meta"):
        model = model_class(tiny_config(**config_fields)).train()
        ids = torch.randint(1, 61, (2, 37))
        labels = torch.randint(0, labels_max, (2, 37))
    counter = KernelCounter()
    with layouts_built_with_values() as layout_reads, counter:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()
    counter.host_syncs += len(layout_reads)
    return counter


@pytest.mark.parametrize(
    "model_class,labels_max,fields",
    [
        pytest.param(RANForMaskedLM, 61, {}, id="masked-lm"),
        pytest.param(RANForTokenClassification, 2, {"num_labels": 2}, id="token-classification"),
        pytest.param(RANForCausalLM, 61, {"is_causal": True}, id="causal-lm"),
    ],
)
def test_a_labelled_training_step_reads_the_device_once(model_class, labels_max, fields):
    """The window layout's sizes, the inputs' checks and the labels' range: one read of the device."""
    assert count_training_step(model_class, labels_max, **fields).host_syncs == 1


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "causal"])
def test_the_triton_scan_launches_four_kernels_per_window_and_layer(causal):
    config = {"scan_implementation": "triton", "is_causal": causal, "window_size": 5, "min_window_size": 2}
    counter = count_training_step(RANForMaskedLM if not causal else RANForCausalLM, 61, **config)
    scan_launches = sum(n for name, n in counter.counts.items() if name.startswith("ran_hf::scan_"))
    windows, layers = 8, 2  # 37 tokens: seven windows of 5 and a tail of 2 (not shorter than min_window_size)
    # and per scan: the first input norm, the last write, the last gradient
    assert scan_launches == layers * (4 * windows + 3)


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
def test_the_triton_norm_and_rotary_replace_their_pytorch_ops(monkeypatch):
    """Every normalisation and rotary embedding of a step is one kernel forward and one backward (counted on meta,
    which stands in for CUDA); switched off, the PyTorch ops run instead."""
    fused = count_training_step(RANForMaskedLM, 61, scan_implementation="triton").counts
    monkeypatch.setattr(triton_norm, "ENABLED", False)
    monkeypatch.setattr(triton_rotary, "ENABLED", False)
    plain = count_training_step(RANForMaskedLM, 61, scan_implementation="triton").counts
    assert fused["ran_hf::rotate_pairs"] == 4 * 2 and "ran_hf::rotate_pairs" not in plain  # q and k, 2 layers, 2 ways
    assert fused["ran_hf::norm_forward"] == fused["ran_hf::norm_backward"] > 0
    assert sum(fused.values()) < sum(plain.values())
    assert fused["aten::rsqrt"] < plain["aten::rsqrt"]


def test_a_decoded_token_reads_the_device_once(monkeypatch):
    """One cached decoding step: the layout's sizes and the inputs' checks in one read (`tolist`), no `item()`."""
    from ran_testing import randomize_

    model = randomize_(RANForCausalLM(tiny_config(is_causal=True)), seed=1).eval()
    ids = torch.randint(1, 61, (2, 23))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append("tolist") or tolist(self))

    class ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name == "aten::_local_scalar_dense":  # item(), bool(), int() of a tensor
                reads.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), ScalarReads():
        model(ids[:, -1:], past_key_values=cache, use_cache=True)
    assert reads == ["tolist"]


@pytest.mark.parametrize(
    "num_labels,labels",
    [
        pytest.param(3, torch.tensor([2, -100]), id="single-label"),
        pytest.param(3, torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]), id="multi-label"),
        pytest.param(1, torch.tensor([0.5, -2.0]), id="regression"),
    ],
)
def test_a_labelled_sequence_classification_step_reads_the_device_once(num_labels, labels):
    from ran_hf import RANForSequenceClassification

    with torch.device("meta"):
        model = RANForSequenceClassification(tiny_config(num_labels=num_labels)).train()
        ids = torch.randint(1, 61, (2, 37))
    counter = KernelCounter()
    with layouts_built_with_values() as layout_reads, counter:
        mask = torch.ones_like(ids)
        model(input_ids=ids, attention_mask=mask, labels=labels.to("meta")).loss.backward()
    assert counter.host_syncs + len(layout_reads) == 1
