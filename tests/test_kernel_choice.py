"""Which implementation each op ran, as `kernels.choose` recorded it (kernels.py): on a CPU the PyTorch ops and the
reference scan; on the meta device, which stands in for CUDA (tests/test_kernel_budget.py counts its launches), the
Triton kernels; compiled or exported, the forms that trace; and where a switch or a module rules a kernel out, the
fallback."""

import pytest
import torch

from benchmark_kernels import layouts_built_with_values

from ran_hf import RANForMaskedLM, kernels
from ran_hf.kernels import choose
from ran_hf.ran_layer import RANLayer
from ran_hf.triton_scan import TRITON_AVAILABLE
from ran_testing import tiny_config

OPS = {"norm", "glu", "rotary", "window_projection", "scan"}


def paths_of_a_training_step(device: str, **config_fields) -> dict:
    """The implementation each op last ran in a training step of a masked LM on `device`."""
    with torch.device(device):
        model = RANForMaskedLM(tiny_config(**config_fields)).train()
        ids = torch.randint(1, 61, (2, 37))
    kernels.CHOSEN.clear()
    with layouts_built_with_values():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    return dict(kernels.CHOSEN)


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
    """"auto" takes the Triton scan on CUDA devices only; each token-wise kernel has its switch."""
    for op in kernels.TRITON_TOKEN_OPS:
        monkeypatch.setitem(kernels.TRITON, op, False)
    chosen = paths_of_a_training_step("meta")
    assert chosen == {
        "norm": "pytorch",
        "glu": "pytorch",
        "rotary": "pytorch",
        "window_projection": "pytorch",
        "scan": "reference",
    }


def scan_choice(requested: str, **config_fields) -> str:
    layer = RANLayer(tiny_config(**config_fields), layer_idx=0)
    return choose("scan", requested, layer.config.hidden_act, layer.cell_scan_weights(), torch.zeros(2, 16))


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
    monkeypatch.setitem(kernels.FORCED, "norm", "triton")
    assert choose("norm", torch.empty(3, 8)) == "triton"
    assert set(kernels.RULES) == OPS
