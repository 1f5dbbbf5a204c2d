"""Saving and loading RAN models: the folder layout, in-process round trips, and loading as remote code."""

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from ran_testing import randomize_, tiny_config
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import ran_hf
from ran_hf import RANForMaskedLM, RANForSequenceClassification, RANForTokenClassification, RANModel
from ran_hf.integrations.rename_cell_weights import main as rename_cell_weights_cli
from ran_hf.integrations.rename_cell_weights import rename_cell_weights


HEADS = [
    pytest.param(RANModel, AutoModel, id="model"),
    pytest.param(RANForMaskedLM, AutoModelForMaskedLM, id="masked-lm"),
    pytest.param(RANForSequenceClassification, AutoModelForSequenceClassification, id="sequence-classification"),
    pytest.param(RANForTokenClassification, AutoModelForTokenClassification, id="token-classification"),
]

EXPECTED_AUTO_MAP = {
    "AutoConfig": "configuration_ran.RANConfig",
    "AutoModel": "modeling_ran.RANModel",
    "AutoModelForMaskedLM": "modeling_ran.RANForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_ran.RANForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_ran.RANForTokenClassification",
}

# A non-default configuration, so that a field lost on the way would change the outputs.
SAVED_CONFIG = {"num_labels": 3, "window_overlap": 1, "cell_pooling": "mean"}


def batch():
    """Two sequences spanning several windows, the second right-padded."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, 64, (2, 13), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    return input_ids, attention_mask


def outputs(model, input_ids, attention_mask):
    """Every tensor a model returns (hidden states included), by name."""
    with torch.no_grad():
        result = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    flat = {}
    for name, value in result.items():
        if isinstance(value, tuple):
            flat.update({f"{name}.{i}": tensor for i, tensor in enumerate(value)})
        else:
            flat[name] = value
    return flat


def without_path(config_dict):
    return {key: value for key, value in config_dict.items() if key != "_name_or_path"}


# The weight names of checkpoints saved while the cell's own GLU and norm were the layer's, not its scan's: refused
# on loading, with the conversion to run (`ran_hf.integrations.rename_cell_weights`).
TODAYS_CELL_WEIGHT = re.compile(r"(layers\.\d+)\.cell_scan\.(cell_glu|cell_norm)\.")
OLD_CELL_WEIGHT = re.compile(r"layers\.\d+\.(cell_glu|cell_norm)\.")


def with_old_weight_names(folder: Path) -> None:
    """Rewrite the folder's weights under the names a checkpoint saved before the scan owned them has."""
    weights = load_file(folder / "model.safetensors")
    renamed = {TODAYS_CELL_WEIGHT.sub(r"\1.\2.", name): tensor for name, tensor in weights.items()}
    assert sum(bool(OLD_CELL_WEIGHT.search(name)) for name in renamed) == 4 * weights_per_layer(folder)
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})


def weights_per_layer(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["num_hidden_layers"]


def saved_weight_names(folder: Path) -> set[str]:
    return set(load_file(folder / "model.safetensors"))


@pytest.fixture
def saved_classifier(make_config, tmp_path):
    """A `RANForSequenceClassification` saved to a folder, returned with the folder."""
    torch.manual_seed(0)
    model = RANForSequenceClassification(make_config(**SAVED_CONFIG)).eval()
    folder = tmp_path / "ran-classifier"
    model.save_pretrained(folder)
    return model, folder


def test_save_pretrained_writes_a_remote_code_folder(saved_classifier):
    """The folder holds safetensors weights, a config whose `auto_map` names every head, and the model's code."""
    _, folder = saved_classifier
    files = {path.name for path in folder.iterdir()}
    assert {"model.safetensors", "config.json", "configuration_ran.py", "modeling_ran.py"} <= files
    assert "pytorch_model.bin" not in files

    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "ran"
    assert config["architectures"] == ["RANForSequenceClassification"]
    assert EXPECTED_AUTO_MAP.items() <= config["auto_map"].items()
    for reference in config["auto_map"].values():
        assert (folder / f"{reference.split('.')[0]}.py").is_file(), reference

    package = Path(ran_hf.__file__).parent
    for name in ("configuration_ran.py", "modeling_ran.py"):  # the package's, with the imports of `files/` made flat
        assert (folder / name).read_text() == (package / name).read_text().replace("from .files.", "from .")
    assert "from .safe_writes import" in (folder / "configuration_ran.py").read_text()
    assert (folder / "safe_writes.py").read_text() == (package / "files" / "safe_writes.py").read_text()


@pytest.mark.parametrize("model_class, auto_class", HEADS)
def test_round_trip_gives_identical_outputs(make_config, tmp_path, model_class, auto_class):
    """Reloading a saved model, by its class or by its Auto class, restores the config and every output exactly."""
    torch.manual_seed(0)
    model = model_class(make_config(**SAVED_CONFIG)).eval()
    model.save_pretrained(tmp_path)
    input_ids, attention_mask = batch()
    expected = outputs(model, input_ids, attention_mask)

    for loader in (model_class, auto_class):
        reloaded = loader.from_pretrained(tmp_path)
        assert type(reloaded) is model_class
        assert not reloaded.training
        assert without_path(reloaded.config.to_dict()) == without_path(model.config.to_dict())
        reloaded_state = reloaded.state_dict()
        assert reloaded_state.keys() == model.state_dict().keys()
        for name, tensor in model.state_dict().items():
            assert torch.equal(reloaded_state[name], tensor), name
        # Identical weights; outputs agree to float rounding (loaded tensors may sit at another memory alignment,
        # which can change the summation order of vectorised kernels).
        actual = outputs(reloaded, input_ids, attention_mask)
        assert actual.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(actual[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert type(AutoConfig.from_pretrained(tmp_path)) is type(model.config)


# Runs in a fresh interpreter where `ran_hf` cannot be imported (see `remote_code.py`): loads the saved folder through
# the Auto classes as remote code, and compares with the outputs the parent process saved.
@pytest.mark.parametrize("is_causal", [False, True], ids=["encoder", "causal"])
def test_a_saved_config_names_the_memory_design_it_resolves_to(is_causal, tmp_path):
    """Fields left to their defaults are saved resolved: a checkpoint keeps its layer if the causal defaults change."""
    config = ran_hf.RANConfig(is_causal=is_causal, hidden_size=16, num_attention_heads=2, head_dim=8)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["residual_stream"] is config.residual_stream is is_causal
    assert saved["attention_qk_activation"] is config.attention_qk_activation is (not is_causal)
    assert saved["memory_value_activation"] is config.memory_value_activation is (not is_causal)
    assert saved["cell_max_pool"] is config.cell_max_pool is is_causal
    # A config saved with the official choices keeps them, whatever the causal defaults say.
    saved.update(attention_qk_activation=True, memory_value_activation=True)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = ran_hf.RANConfig.from_pretrained(tmp_path)
    assert loaded.attention_qk_activation and loaded.memory_value_activation


@pytest.mark.parametrize("field", ["cell_max_pool", "review_salience", "token_shift"])
def test_a_causal_config_saved_before_a_memory_field_existed_loads_without_it(tmp_path, field):
    """A config that names its memory design but not a field added later was trained without it, whatever the
    default."""
    config = ran_hf.RANConfig(is_causal=True, hidden_size=16, num_attention_heads=2, head_dim=8)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved[field] is getattr(config, field) is True
    del saved[field]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert not getattr(ran_hf.RANConfig.from_pretrained(tmp_path), field)
    assert getattr(ran_hf.RANConfig.from_pretrained(tmp_path, **{field: True}), field)
    # A config written by hand, naming no memory field, takes today's causal defaults.
    assert getattr(ran_hf.RANConfig.from_dict({"is_causal": True}), field)


@pytest.mark.parametrize("field", ["review_salience", "token_shift"])
def test_a_causal_checkpoint_saved_before_a_memory_field_existed_loads_exactly(tmp_path, field):
    """Its weights hold none of the field's parameters, and none are made up: the model loads every weight and
    computes as saved."""
    model = ran_hf.RANForCausalLM(tiny_config(is_causal=True, **{field: False})).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved[field]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded, info = ran_hf.RANForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(1, model.config.vocab_size, (2, 19))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


# Every head with the Auto class that loads it (the prefix LM is a sequence-to-sequence model to the Auto classes).
EVERY_HEAD = {
    "RANModel": "AutoModel",
    "RANForMaskedLM": "AutoModelForMaskedLM",
    "RANForSequenceClassification": "AutoModelForSequenceClassification",
    "RANForTokenClassification": "AutoModelForTokenClassification",
    "RANForQuestionAnswering": "AutoModelForQuestionAnswering",
    "RANForCausalLM": "AutoModelForCausalLM",
    "RANForPrefixLM": "AutoModelForSeq2SeqLM",
}


CONVERSION = "python -m ran_hf.integrations.rename_cell_weights"


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.parametrize("name", EVERY_HEAD)
def test_a_checkpoint_with_the_old_cell_weight_names_is_refused_and_converts_to_load_exactly(
    name, make_config, tmp_path, capsys
):
    """No renaming is registered (no public checkpoint has the old names, `layers.N.cell_glu.*` and
    `layers.N.cell_norm.*`): by the head's class, its Auto class, a state dict or `load_state_dict`, loading them is
    refused before any weight is read, naming an old weight and the conversion. Converted, the folder loads exactly,
    its other files untouched."""
    model = getattr(ran_hf, name)(make_config(is_causal=name == "RANForCausalLM", window_overlap=1))
    model = randomize_(model, seed=3).eval()  # no weight left at a value its initialisation would give anyway
    old = tmp_path / "old"
    model.save_pretrained(old)
    todays_names = saved_weight_names(old)
    with_old_weight_names(old)
    old_state = load_file(old / "model.safetensors")
    first_old = min(weight for weight in old_state if OLD_CELL_WEIGHT.search(weight))

    loaders = [getattr(ran_hf, name).from_pretrained, getattr(transformers, EVERY_HEAD[name]).from_pretrained]
    loaders.append(
        lambda folder: getattr(ran_hf, name).from_pretrained(None, config=model.config, state_dict=old_state)
    )
    loaders.append(lambda folder: model.load_state_dict(old_state, strict=False))  # would drop them silently
    if name == "RANModel":  # a bare model's names under a head's prefix
        loaders.append(AutoModelForSequenceClassification.from_pretrained)
    for load in loaders:
        with pytest.raises(ValueError, match=re.escape(first_old)) as refused:
            load(old)
        assert CONVERSION in str(refused.value) and "cell_scan.cell_norm" in str(refused.value)

    before = folder_bytes(old)
    rename_cell_weights_cli([str(old)])
    assert capsys.readouterr().out == f"Renamed {4 * model.config.num_hidden_layers} cell weights in {old}.\n"
    after = folder_bytes(old)
    assert after.keys() == before.keys()
    assert {file: data for file, data in after.items() if file != "model.safetensors"} == {
        file: data for file, data in before.items() if file != "model.safetensors"
    }
    assert saved_weight_names(old) == todays_names

    input_ids, attention_mask = batch()
    expected = outputs(model, input_ids, attention_mask)
    for loader in (getattr(ran_hf, name), getattr(transformers, EVERY_HEAD[name])):
        loaded, info = loader.from_pretrained(old, output_loading_info=True)
        assert type(loaded) is type(model)
        assert not any(info.values()), info
        loaded_state = loaded.state_dict()
        assert loaded_state.keys() == model.state_dict().keys()
        for weight, tensor in model.state_dict().items():
            assert torch.equal(loaded_state[weight], tensor), weight
        actual = outputs(loaded, input_ids, attention_mask)
        for output, tensor in expected.items():
            torch.testing.assert_close(actual[output], tensor, rtol=0, atol=1e-6, msg=output)

    assert rename_cell_weights(old) == 0  # nothing left to rename: nothing rewritten
    assert folder_bytes(old) == after


def test_a_file_with_a_weight_under_its_old_and_new_name_loads_neither(make_config, tmp_path):
    """Which of the two is meant cannot be told: loading and the conversion refuse it, naming both, and the folder
    stays as it was."""
    model = RANForMaskedLM(make_config())
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.cell_norm.weight"] = torch.zeros_like(weights["model.layers.0.cell_scan.cell_norm.weight"])
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    before = folder_bytes(tmp_path)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.cell_norm\.weight.*model\.layers\.0\.cell_scan\.cell_norm"
    ):
        RANForMaskedLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.cell_norm\.weight and model\.layers\.0\.cell_scan\."):
        rename_cell_weights(tmp_path)
    assert folder_bytes(tmp_path) == before


def test_a_sharded_checkpoint_with_the_old_names_converts_every_shard_and_its_index(make_config, tmp_path):
    model = randomize_(RANForMaskedLM(make_config()), seed=5).eval()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    with_old_names = 0
    for shard in shards:  # old names in the shards and in the index
        renamed = {TODAYS_CELL_WEIGHT.sub(r"\1.\2.", weight): t for weight, t in load_file(shard).items()}
        save_file(renamed, shard, metadata={"format": "pt"})
        with_old_names += any(map(OLD_CELL_WEIGHT.search, renamed))
    assert with_old_names >= 2  # more than one shard to rewrite
    index["weight_map"] = {TODAYS_CELL_WEIGHT.sub(r"\1.\2.", weight): s for weight, s in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=CONVERSION):
        RANForMaskedLM.from_pretrained(tmp_path)

    assert rename_cell_weights(tmp_path) == 4 * model.config.num_hidden_layers
    assert not any(OLD_CELL_WEIGHT.search(weight) for weight in json.loads(index_file.read_text())["weight_map"])
    loaded, info = RANForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    for weight, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[weight], tensor), weight


def test_the_conversion_names_a_folder_it_cannot_convert(tmp_path):
    with pytest.raises(NotADirectoryError, match=re.escape(f"{tmp_path / 'missing'} is not a folder")):
        rename_cell_weights(tmp_path / "missing")
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"holds only pytorch_model\.bin.*renamed_cell_weights"):
        rename_cell_weights(tmp_path)
