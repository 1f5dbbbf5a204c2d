"""The adaptive-softmax causal LM (`cutoffs`, `div_val`; the official `RanNetForAdaptiveLM`): parity of its adaptive
embedding, output mapping and softmax with rannet on converted checkpoints, the loss (Transformers' conventions,
without the full softmax), generation, padding, the cache, save/load and remote code, and errors on bad configs.

The references were computed by rannet 0.3.1 (`scripts/rannet_tf/make_rannet_cell_and_adaptive_fixtures.py`); no
TensorFlow is needed here. The causal RAN layers themselves follow the strictly causal design (RAN_ARCHITECTURE.md,
"Causal language modelling"), not rannet's causal mode, so whole-model outputs are compared with the model's own
parts, not with rannet's.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ran_testing import CONFIG_ERROR, pad_batch, random_ids, randomize_, real_positions, tiny_config
from remote_code import run_without_ran_hf
from tf_checkpoint_writer import write_checkpoint
from transformers import AutoModelForCausalLM

from ran_hf import RANConfig, RANForCausalLM, convert_rannet_checkpoint
from ran_hf.adaptive_softmax import RANAdaptiveSoftmax
from ran_hf.files.tf_checkpoint import TFCheckpointReader


FIXTURES = Path(__file__).parent / "fixtures" / "rannet"
ADAPTIVE = ["adaptive_l2_d16_w6_div2", "adaptive_l1_d16_w4_div1"]
TOLERANCE = 1e-4  # float32 against float32 (measured: under 3e-6)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return {name: convert_rannet_checkpoint(FIXTURES / name, root / name) for name in ADAPTIVE}


@pytest.mark.parametrize("name", ADAPTIVE)
def test_converted_adaptive_parts_match_rannet(name, converted):
    model = AutoModelForCausalLM.from_pretrained(converted[name]).eval()
    assert type(model) is RANForCausalLM and model.config.is_causal
    card = (converted[name] / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card and "cutoffs / div_val" in card
    official = json.loads((FIXTURES / name / "adaptive.json").read_text())
    if official["div_val"] == 1:  # rannet's div_val 1 layers ignore cutoffs: one tied softmax
        assert (model.config.cutoffs, model.config.div_val) == ([], 1)
    else:
        assert (model.config.cutoffs, model.config.div_val) == (official["cutoffs"], official["div_val"])
    expected = np.load(FIXTURES / name / "expected.npz")
    input_ids = torch.from_numpy(expected["input_ids"]).long()
    embedding = model.model.embeddings.word_embeddings
    with torch.no_grad():
        embedded = embedding(input_ids)
        log_probs = model.decoder(model.head(torch.from_numpy(expected["token_states"])), embedding)
    for what, actual, reference in (
        ("adaptive embedding", embedded, expected["embeddings"]),
        ("output mapping and adaptive softmax", log_probs, expected["log_probs"]),
    ):
        diff = (actual - torch.from_numpy(reference)).abs().max().item()
        assert diff <= TOLERANCE, f"{name} {what}: max abs diff {diff:.2e}"


def adaptive_model(**overrides):
    values = {"is_causal": True, "vocab_size": 61, "cutoffs": [10, 30], "div_val": 2}
    values.update(overrides)
    return randomize_(RANForCausalLM(tiny_config(**values)))


@pytest.mark.parametrize("cutoffs,div_val", [([10, 30], 2), ([7], 4), ([], 2), ([20], 1)])
def test_loss_is_the_full_distributions_and_never_builds_it(cutoffs, div_val, monkeypatch):
    model = adaptive_model(cutoffs=cutoffs, div_val=div_val)
    input_ids, attention_mask = pad_batch([random_ids(13, 61, 0), random_ids(7, 61, 1)])
    labels = input_ids.clone()
    labels[0, 3] = -100
    with torch.no_grad():
        log_probs = model(input_ids, attention_mask=attention_mask).logits  # (B, L, V) float32
        assert torch.allclose(log_probs.exp().sum(-1), torch.ones(()), atol=1e-5)
        targets = labels.masked_fill(attention_mask == 0, -100)[:, 1:]
        expected = F.nll_loss(log_probs[:, :-1].reshape(-1, 61), targets.reshape(-1))
        expected_sum = F.nll_loss(log_probs[:, :-1].reshape(-1, 61), targets.reshape(-1), reduction="sum")
    monkeypatch.setattr(RANAdaptiveSoftmax, "forward", lambda *args: pytest.fail("the loss built every log-prob"))
    with torch.no_grad():
        output = model(input_ids, attention_mask=attention_mask, labels=labels)
        accumulated = model(input_ids, attention_mask=attention_mask, labels=labels, num_items_in_batch=40)
    assert output.logits is None
    torch.testing.assert_close(output.loss, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(accumulated.loss, expected_sum / 40, rtol=0, atol=1e-5)


def test_a_tail_is_scored_only_for_its_targets(monkeypatch):
    model = adaptive_model()
    rows_seen = []
    tail = RANAdaptiveSoftmax.tail_log_probs
    monkeypatch.setattr(
        RANAdaptiveSoftmax,
        "tail_log_probs",
        lambda self, h, e, i, head: rows_seen.append(h.shape[0]) or tail(self, h, e, i, head),
    )
    input_ids = torch.tensor([[1, 2, 3, 40, 41, 12, 5]])  # targets: 2 3 40 41 12 5 -> one in [10, 30), two in [30, 61)
    model(input_ids, labels=input_ids).loss.backward()
    assert rows_seen == [1, 2]


def test_nothing_to_score_gives_zero_and_gradients():
    model = adaptive_model().train()
    input_ids = random_ids(9, 61, 2)[None]
    loss = model(input_ids, labels=torch.full_like(input_ids, -100)).loss
    loss.backward()
    assert loss.item() == 0.0 and model.head.dense.weight.grad is not None


def test_generate_padding_and_cache():
    model = adaptive_model(eos_token_id=None, pad_token_id=0)
    prompt = random_ids(6, 61, 4)[None]
    generated = model.generate(prompt, max_new_tokens=7, do_sample=False)
    expected = prompt
    with torch.no_grad():
        for _ in range(7):
            expected = torch.cat([expected, model(expected).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(generated, expected)
        sequences = [random_ids(n, 61, seed) for seed, n in enumerate((13, 4, 9))]
        for side in ("left", "right"):
            input_ids, attention_mask = pad_batch(sequences, side=side)
            batch = model(input_ids, attention_mask=attention_mask).logits
            for row, sequence in enumerate(sequences):
                alone = model(sequence[None]).logits[0]
                torch.testing.assert_close(batch[row, real_positions(attention_mask[row])], alone)
        full = model(sequences[0][None]).logits
        prefix = model(sequences[0][None, :8], use_cache=True)
        rest = model(sequences[0][None, 8:], past_key_values=prefix.past_key_values)
        torch.testing.assert_close(torch.cat([prefix.logits, rest.logits], dim=1), full, rtol=0, atol=1e-5)


def test_save_load_and_remote_code(tmp_path):
    model = adaptive_model()
    # The plain PyTorch scan, which the folder runs where `ran_hf` (and its fused scan) is not installed.
    model.config.scan_implementation = "reference"
    model.save_pretrained(tmp_path / "adaptive")
    assert (tmp_path / "adaptive" / "adaptive_softmax.py").is_file()  # copied beside the modeling code
    input_ids, attention_mask = pad_batch([random_ids(13, 61, 0), random_ids(7, 61, 1)])
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "adaptive").eval()
        torch.testing.assert_close(reloaded(input_ids, attention_mask=attention_mask).logits, expected)
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask, "logits": expected}, tmp_path / "x.pt")
    report = run_without_ran_hf(
        r"""
import torch
from transformers import AutoModelForCausalLM
expected = torch.load(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).logits
    loss = model(input_ids=expected["input_ids"], labels=expected["input_ids"]).loss
report["class"] = type(model).__module__ + "." + type(model).__name__
report["difference"] = (logits - expected["logits"]).abs().max().item()
report["loss"] = loss.item()
""",
        [tmp_path / "adaptive", tmp_path / "x.pt"],
        tmp_path,
    )
    assert report["class"].startswith("transformers_modules.")
    assert report["difference"] <= 1e-6 and report["loss"] > 0


BAD_CONFIGS = [
    pytest.param({"cutoffs": [30, 10]}, "strictly increasing", id="decreasing"),
    pytest.param({"cutoffs": [10, 61]}, "strictly increasing ids in \\(0, vocab_size=61\\)", id="past-vocabulary"),
    pytest.param({"cutoffs": [0, 10]}, "strictly increasing", id="zero"),
    pytest.param({"cutoffs": "10"}, "(?s)field 'cutoffs'.*expected a list", id="string"),
    pytest.param({"cutoffs": [10.0]}, "(?s)field 'cutoffs'.*Invalid item", id="float"),
    pytest.param({"cutoffs": [10], "is_causal": False}, "belong to the causal LM", id="encoder"),
    pytest.param({"cutoffs": [10], "div_val": 0}, "(?s)field 'div_val'.*got 0", id="div-val-0"),
    pytest.param({"cutoffs": [5, 10, 20, 30, 40], "div_val": 2}, "clusters no dimension", id="too-narrow"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS)
def test_bad_adaptive_configs_are_named(overrides, message):
    values = {
        **{"vocab_size": 61, "hidden_size": 16, "num_attention_heads": 2, "head_dim": 8, "is_causal": True},
        **overrides,
    }
    with pytest.raises(CONFIG_ERROR, match=message):
        RANConfig(**values)


SOFTMAX_BIAS = "layer_with_weights-5/bias-2/.ATTRIBUTES/VARIABLE_VALUE"
TAIL_EMBEDDING = "layer_with_weights-0/embeddings-2/.ATTRIBUTES/VARIABLE_VALUE"
BAD_CHECKPOINTS = [
    pytest.param(lambda tensors: tensors.pop(SOFTMAX_BIAS), "adaptive-softmax/bias-2' is missing", id="missing-bias"),
    pytest.param(
        lambda tensors: tensors.update({TAIL_EMBEDDING: np.zeros((18, 3), np.float32)}),
        "no `cutoffs`/`div_val` give",
        id="inconsistent-widths",
    ),
    pytest.param(
        lambda tensors: tensors.update({"layer_with_weights-5/kernel-3/.ATTRIBUTES/VARIABLE_VALUE": np.zeros(2)}),
        "unexpected variable.*kernel-3.*adaptive-LM checkpoint",
        id="unknown-variable",
    ),
]


@pytest.mark.parametrize("damage,message", BAD_CHECKPOINTS)
def test_bad_adaptive_checkpoints_are_named(damage, message, tmp_path):
    folder = tmp_path / "rannet"
    shutil.copytree(FIXTURES / "adaptive_l2_d16_w6_div2", folder)
    reader = TFCheckpointReader(folder / "model.weights")
    tensors = {name: reader.read(name) for name in reader.entries if not name.startswith("_CHECKPOINTABLE")}
    damage(tensors)
    write_checkpoint(folder / "model.weights", tensors)
    with pytest.raises(ValueError, match=message):
        convert_rannet_checkpoint(folder, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()
