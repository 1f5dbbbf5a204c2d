"""Configs saved before a change keep loading and computing what they were trained to compute.

`tests/fixtures/saved_configs/` holds tiny models (config and weights, no code) saved before the layer's variants
became named designs (`RANConfig.layer_design`): the official encoder, today's causal design with a bounded and
salient memory, and a causal model built from the official layer. Each loads with today's code and gives the logits
saved with it.
"""

import json
from pathlib import Path

import pytest
import torch

from ran_hf import RANConfig, RANForCausalLM, RANForMaskedLM
from ran_hf.configuration_ran import LAYER_DESIGNS


FIXTURES = Path(__file__).parent / "fixtures" / "saved_configs"
CASES = {
    "encoder_official": (RANForMaskedLM, "official"),
    "causal_learnable_memory": (RANForCausalLM, "learnable_memory"),
    "causal_official_layer": (RANForCausalLM, "official"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_saved_model_computes_what_it_computed(name):
    model_class, _ = CASES[name]
    model = model_class.from_pretrained(FIXTURES / name).eval()
    expected = torch.load(FIXTURES / name / "expected.pt")
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_saved_config_resolves_to_the_design_its_fields_name(name):
    saved = json.loads((FIXTURES / name / "config.json").read_text())
    config = RANConfig.from_pretrained(FIXTURES / name)
    design = CASES[name][1]
    for field, value in LAYER_DESIGNS[design].items():
        assert saved[field] == value, field  # the fixture names every field, as `to_dict` writes them
        assert getattr(config, field) is value, field
    # Saved again, it names its design too, and the fields keep their values.
    resaved = config.to_dict()
    assert resaved["layer_design"] == design
    assert {field: resaved[field] for field in LAYER_DESIGNS[design]} == LAYER_DESIGNS[design]
