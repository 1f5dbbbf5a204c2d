"""What a GPU would launch, counted on the meta device (scripts/benchmarks/benchmark_kernels.py): the Triton scan is
four kernels per window and layer plus three per scan, and a labelled training forward reads the device twice, both
before any token is embedded: the head its labels' checks, then the base model its window layout's sizes and its
inputs' checks together. The count's bytes: per model part,
backward ops included, and as a GPU moves them (dropout fused, broadcasts read once, no bytes for allocations)."""

import copy

import pytest
import torch
from benchmark_kernels import FusedOpsAsOnGPU, KernelCounter, footprint, layouts_built_with_values
from ran_testing import tiny_config
from torch import nn

from ran_hf import RANForCausalLM, RANForMaskedLM, RANForTokenClassification
from ran_hf.kernels import choice as kernel_choice
from ran_hf.kernels.choice import TRITON_AVAILABLE


def count_training_step(model_class, labels_max, **config_fields):
    with torch.device("meta"):
        model = model_class(tiny_config(**config_fields)).train()
        ids = torch.randint(1, 61, (2, 37))
        labels = torch.randint(0, labels_max, (2, 37))
    counter = KernelCounter()
    with layouts_built_with_values() as reads, counter:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()
    counter.reads = [kind for kind, _ in reads]
    counter.host_syncs += len(reads)
    return counter


@pytest.mark.parametrize(
    "model_class,labels_max,fields",
    [
        pytest.param(RANForMaskedLM, 61, {}, id="masked-lm"),
        pytest.param(RANForTokenClassification, 2, {"num_labels": 2}, id="token-classification"),
        pytest.param(RANForCausalLM, 61, {"is_causal": True}, id="causal-lm"),
    ],
)
def test_a_labelled_training_step_reads_the_device_twice_before_embedding(model_class, labels_max, fields):
    """The head reads its labels' range, then the base model its window layout's sizes and the inputs' checks: two
    reads, both before any token is embedded, and none after."""
    counter = count_training_step(model_class, labels_max, **fields)
    assert counter.reads == ["labels", "layout"]
    assert counter.host_syncs == 2


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
def test_the_triton_token_wise_kernels_replace_their_pytorch_ops(monkeypatch):
    """Every normalisation, token-wise gated linear unit and window projection (activation, gather into windows,
    rotary embedding) of a step is one kernel forward and one backward (counted on meta, which stands in for CUDA);
    switched off, the PyTorch ops run instead."""
    fused = count_training_step(RANForMaskedLM, 61, scan_implementation="triton")
    for op in kernel_choice.TRITON_TOKEN_OPS:
        monkeypatch.setitem(kernel_choice.TRITON, op, False)
    plain = count_training_step(RANForMaskedLM, 61, scan_implementation="triton")
    fused_counts, plain_counts = fused.counts, plain.counts
    projections = ("ran_hf::window_projection", "ran_hf::window_projection_backward")
    assert [fused_counts[name] for name in projections] == [2, 2] and not any(map(plain_counts.get, projections))
    assert "ran_hf::rotate_pairs" not in fused_counts  # the rotary embedding is in the projection
    assert fused_counts["ran_hf::norm_forward"] == fused_counts["ran_hf::norm_backward"] > 0
    # the attention's gated residual and the memory review's, in each of 2 layers (the cell's is in the scan)
    assert fused_counts["ran_hf::glu_forward"] == fused_counts["ran_hf::glu_backward"] == 2 * 2
    assert "ran_hf::glu_forward" not in plain_counts
    assert fused_counts["aten::sigmoid"] < plain_counts["aten::sigmoid"]
    assert sum(fused_counts.values()) < sum(plain_counts.values())
    assert fused_counts["aten::rsqrt"] < plain_counts["aten::rsqrt"]
    assert fused.other_bytes < plain.other_bytes


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
def test_training_dropout_of_the_token_states_runs_inside_the_triton_kernels():
    """With dropout, the layers' token states are dropped inside the norm and GLU kernels (mask seeds drawn on the
    device: no host read; the attention's and the memory review's LayerNorms inside their GLU's); PyTorch's dropout
    is left for the scan's masks (two draws per layer's scan), the memory review's attention weights (one per layer),
    the head's input and the first layer's starting cell."""
    with torch.device("meta"):
        config = tiny_config(scan_implementation="triton", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
        model = RANForMaskedLM(config).train()
        ids = torch.randint(1, 61, (2, 37))
    counter = KernelCounter()
    with layouts_built_with_values() as reads, counter, FusedOpsAsOnGPU():  # dropout as CUDA runs it
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    counts, layers = counter.counts, config.num_hidden_layers
    # a seed per GLU (its branch's and its norm's masks: two a layer), the input norm's, the embeddings' norm's
    assert counts["aten::randint"] == layers * 3 + 1
    assert counts["aten::bernoulli_"] == layers * 2
    assert counts["aten::native_dropout"] == layers + 2
    assert counter.host_syncs + len(reads) == 2  # the labels', then the layout's: the dropout seeds read nothing


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.act, self.layers = nn.Linear(4, 4), nn.SiLU(), nn.ModuleList([nn.Tanh(), nn.Tanh()])

    def forward(self, x):
        x = self.act(self.first(x))
        for layer in self.layers:
            x = layer(x)
        return self.total(x)

    def total(self, x):
        return (x * 2).sum()


def test_bytes_are_counted_per_model_part_forward_and_backward():
    """A part is a module (layer numbers folded) and the function its forward called; a backward op counts for the
    part whose forward made its autograd node. Float32 (8, 4): 128 bytes a tensor."""
    with torch.device("meta"):
        model, x = Toy(), torch.empty(8, 4)
    counter = KernelCounter(model)
    with counter:
        model(x).backward()
    assert counter.bytes_by_part == {
        "act": 2 * 128 + 3 * 128,  # silu reads x, writes; its backward reads the gradient and x, writes
        "layers.*": 2 * (2 * 128 + 3 * 128),  # tanh, twice
        "Toy (total)": (128 + 128) + (4 + 128) + (128 + 4),  # x * 2, its gradient (from a broadcast: 4), the sum
        "first": 128 + 16,  # the bias's gradient, a sum over rows (the products are FLOPs, not bytes)
        "(outside the model)": 4,  # the loss's gradient of ones
    }
    assert sum(counter.bytes_by_op.values()) == counter.other_bytes == sum(counter.bytes_by_part.values())


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
def test_a_ran_step_leaves_no_bytes_unattributed():
    with torch.device("meta"):
        model = RANForMaskedLM(tiny_config(scan_implementation="triton")).train()
        ids = torch.randint(1, 61, (2, 37))
    counter = KernelCounter(model)
    with layouts_built_with_values(), counter:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    parts = counter.bytes_by_part
    # (each part named by the kernel that ran: the one attached to the GLU's forward, and to the layer's projection)
    assert parts["model.layers.*.attention_glu (triton_glu_forward)"] > 0
    assert parts["model.layers.* (triton_window_projection)"] > 0
    assert sum(moved for part, moved in parts.items() if part.startswith("(")) < 1e-3 * counter.other_bytes


def test_dropout_is_counted_as_the_fused_kernel_a_gpu_runs():
    """One kernel each way that writes (and reads back) a boolean mask, not meta's mask of floats, scale and product;
    outside training, nothing."""
    with torch.device("meta"):
        dropout, x = nn.Dropout(0.1), torch.empty(8, 4, requires_grad=True)
    counter = KernelCounter()
    with counter, FusedOpsAsOnGPU():
        dropout(x).sum().backward()
    assert counter.counts["aten::native_dropout"] == counter.counts["aten::native_dropout_backward"] == 1
    assert "aten::bernoulli_" not in counter.counts and "aten::mul" not in counter.counts
    counter = KernelCounter()
    with counter, FusedOpsAsOnGPU():
        dropout.eval()(x)
    assert not counter.counts


def test_bytes_count_a_broadcast_axis_once_and_an_allocation_not_at_all():
    with torch.device("meta"):
        row = torch.empty(1, 1000)
        assert footprint(row.expand(64, 1000)) == footprint(row) == 4000
        assert footprint(torch.empty(64, 1000)[:, :10]) == 64 * 10 * 4
        counter = KernelCounter()
        with counter:
            torch.empty(64, 1000).new_zeros(3, 5)
            torch.empty(6, 4).view(24)
    assert counter.other_bytes == 3 * 5 * 4  # the zeros written, not the tensor that gave their dtype


def test_a_decoded_token_reads_the_device_only_through_the_general_pass(monkeypatch):
    """A cached decoding step (one token per row, no mask) reads only its input's checks to the host, on the CPU,
    where a read waits for nothing (on a GPU it asserts them on the device: test_per_call_cost.py counts no read on
    the meta device); the same token with a mask takes the general pass, which reads the layout's sizes and the
    inputs' checks in one read (`tolist`). Neither calls `item()`. Both give the same logits."""
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

    token, mask = ids[:, -1:], torch.ones(2, 24, dtype=torch.long)
    with torch.no_grad(), ScalarReads():
        stepped = model(token, past_key_values=copy.deepcopy(cache), use_cache=True).logits
        assert reads == ["tolist"]
        general = model(token, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    assert reads == ["tolist", "tolist"]
    torch.testing.assert_close(stepped, general, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_labels,labels",
    [
        pytest.param(3, torch.tensor([2, -100]), id="single-label"),
        pytest.param(3, torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]), id="multi-label"),
        pytest.param(1, torch.tensor([0.5, -2.0]), id="regression"),
    ],
)
def test_a_labelled_sequence_classification_step_reads_the_labels_once(num_labels, labels):
    """The head's read of its labels (on the device), then the layout's; none after."""
    from ran_hf import RANForSequenceClassification

    with torch.device("meta"):
        model = RANForSequenceClassification(tiny_config(num_labels=num_labels)).train()
        ids = torch.randint(1, 61, (2, 37))
    counter = KernelCounter()
    with layouts_built_with_values() as reads, counter:
        mask = torch.ones_like(ids)
        model(input_ids=ids, attention_mask=mask, labels=labels.to("meta")).loss.backward()
    assert counter.host_syncs == 0 and [kind for kind, _ in reads] == ["labels", "layout"]
