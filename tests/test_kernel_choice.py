"""Which implementation each op ran, as `choice.choose` recorded it (ran_hf/kernels/choice.py): on a CPU the PyTorch ops and the
reference scan; on the meta device, which stands in for CUDA (tests/test_kernel_budget.py counts its launches), the
Triton kernels; compiled or exported, the forms that trace; and where a switch or a module rules a kernel out, the
fallback. Where an op runs "pytorch", what runs is its `*_reference` function, which asks nothing of `choose`."""

import pytest
import torch
from benchmark_kernels import layouts_built_with_values
from ran_testing import pad_batch, random_ids, randomize_, tiny_config

from ran_hf import RANForMaskedLM
from ran_hf.building_blocks import (
    RANCenteredRMSNorm,
    RANGatedLinearUnit,
    apply_interleaved_rotary,
    centered_rms_norm_reference,
    gated_linear_unit_reference,
    rotary_rotations,
    rotate_pairs_reference,
    standard_normalize,
    standard_normalize_reference,
)
from ran_hf.kernels import choice as kernel_choice
from ran_hf.kernels.choice import TRITON_AVAILABLE, choose
from ran_hf.ran_layer import RANLayer
from ran_hf.window_layout import RANWindowLayout


OPS = {"norm", "glu", "rotary", "window_projection", "scan"}


def paths_of_a_training_step(device: str, **config_fields) -> dict:
    """The implementation each op last ran in a training step of a masked LM on `device`."""
    with torch.device(device):
        model = RANForMaskedLM(tiny_config(**config_fields)).train()
        ids = torch.randint(1, 61, (2, 37))
    kernel_choice.CHOSEN.clear()
    with layouts_built_with_values():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    return dict(kernel_choice.CHOSEN)


@pytest.mark.parametrize("scan,runs", [("auto", "reference"), ("reference", "reference"), ("fused", "fused")])
def test_on_a_cpu_every_op_runs_pytorch_and_the_scan_the_one_asked_for(scan, runs):
    chosen = paths_of_a_training_step("cpu", scan_implementation=scan)
    assert chosen == {
        "norm": "pytorch",
        "glu": "pytorch",
        "rotary": "pytorch",
        "window_projection": "pytorch",
        "scan": runs,
    }


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
def test_on_meta_every_op_runs_its_triton_kernel():
    """The rotary embedding runs inside the window projection's kernel: the op itself is never asked."""
    chosen = paths_of_a_training_step("meta", scan_implementation="triton")
    assert chosen == {"norm": "triton", "glu": "triton", "window_projection": "triton", "scan": "triton"}


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
def test_on_meta_the_default_scan_is_the_reference_and_switches_turn_kernels_off(monkeypatch):
    """ "auto" takes the Triton scan on CUDA devices only; each token-wise kernel has its switch."""
    for op in kernel_choice.TRITON_TOKEN_OPS:
        monkeypatch.setitem(kernel_choice.TRITON, op, False)
    chosen = paths_of_a_training_step("meta")
    assert chosen == {
        "norm": "pytorch",
        "glu": "pytorch",
        "rotary": "pytorch",
        "window_projection": "pytorch",
        "scan": "reference",
    }


def token_op_inputs():
    generator = torch.Generator().manual_seed(3)
    states = torch.randn(3, 5, 8, generator=generator) * 3 + 1
    norm, glu = randomize_(RANCenteredRMSNorm(8, 1e-6)), randomize_(RANGatedLinearUnit(8))
    rotations = rotary_rotations(5, 8, 10000.0, "cpu")
    return states, torch.randn(3, 5, 8, generator=generator), norm, glu, rotations


def test_on_a_cpu_each_op_runs_its_reference_function():
    """Each public op's output equals its reference function's bit for bit (dropout drawn from the same seed), and
    `choose` recorded "pytorch" for it."""
    states, residual, norm, glu, rotations = token_op_inputs()
    dropout, silu = torch.nn.Dropout(0.3).train(), torch.nn.SiLU()

    def same(public, reference):
        torch.manual_seed(0)
        expected = reference()
        torch.manual_seed(0)
        return torch.equal(public(), expected)

    kernel_choice.CHOSEN.clear()
    assert same(
        lambda: standard_normalize(states, 1e-6, dropout), lambda: standard_normalize_reference(states, 1e-6, dropout)
    )
    for then_standardize in (False, True):
        assert same(
            lambda: norm(states, dropout, then_standardize),
            lambda: centered_rms_norm_reference(states, norm.weight, norm.bias, 1e-6, dropout, then_standardize),
        )
    assert same(lambda: glu(states), lambda: gated_linear_unit_reference(glu.proj(states)))
    rows = torch.tensor([2, 0, 1])
    assert same(
        lambda: glu(states, residual, silu, dropout, rows),
        lambda: gated_linear_unit_reference(glu.proj(states), residual, silu, dropout, rows),
    )
    assert same(lambda: apply_interleaved_rotary(states, rotations), lambda: rotate_pairs_reference(states, rotations))
    config = tiny_config(window_overlap=2)
    layer = randomize_(RANLayer(config, layer_idx=0))
    _, mask = pad_batch([random_ids(n, config.vocab_size, n) for n in (13, 6)])
    layout = RANWindowLayout.from_attention_mask(mask, config)
    normed = torch.randn(19, config.hidden_size)
    table = layout.rotary(layer.head_dim, config.rope_theta, normed.device)
    public = layer.project_windows(normed, layout, None)
    reference = layer.project_windows_reference(normed, layout, None, table)
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(public, reference, strict=True))
    assert kernel_choice.CHOSEN == dict.fromkeys(kernel_choice.TRITON_TOKEN_OPS, "pytorch")


def test_the_reference_functions_ask_nothing_of_choose(monkeypatch):
    """Forced to Triton, the public ops would run their kernels; the reference functions still run PyTorch's ops
    and record no choice."""
    states, residual, norm, glu, rotations = token_op_inputs()
    for op in kernel_choice.TRITON_TOKEN_OPS:
        monkeypatch.setitem(kernel_choice.FORCED, op, "triton")
    kernel_choice.CHOSEN.clear()
    standard_normalize_reference(states, 1e-6)
    centered_rms_norm_reference(states, norm.weight, norm.bias, 1e-6, then_standardize=True)
    gated_linear_unit_reference(glu.proj(states), residual, torch.nn.SiLU())
    rotate_pairs_reference(states, rotations)
    assert kernel_choice.CHOSEN == {}


def scan_choice(requested: str, **config_fields) -> str:
    layer = RANLayer(tiny_config(**config_fields), layer_idx=0)
    modules_read = layer.cell_scan.modules_read(layer.cell_scan_weights())
    return choose("scan", requested, layer.config.hidden_act, modules_read, torch.zeros(2, 16))


def test_the_scan_falls_back_where_its_kernel_cannot_run():
    assert scan_choice("reference") == "reference"
    assert scan_choice("fused") == "fused"
    assert scan_choice("fused", hidden_act="gelu") == "reference"  # the fused scan computes SiLU only
    assert scan_choice("counting-someday") == "counting-someday"  # a registered scan runs as it is


def test_compiled_the_token_ops_run_pytorch_and_the_reference_scan_its_single_op(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    meta = torch.empty(4, 16, device="meta")
    assert [choose(op, meta) for op in ("norm", "glu", "rotary")] == ["pytorch"] * 3
    assert choose("window_projection", meta, "silu", False) == "pytorch"
    assert scan_choice("reference") == scan_choice("triton") == "fused"
    assert scan_choice("reference", hidden_act="gelu") == "reference"  # unrolled, and it says so
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    assert scan_choice("reference") == "export"


def test_forced_wins_over_the_rule(monkeypatch):
    monkeypatch.setitem(kernel_choice.FORCED, "norm", "triton")
    assert choose("norm", torch.empty(3, 8)) == "triton"
    assert set(kernel_choice.RULES) == OPS
