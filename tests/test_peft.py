"""LoRA with PEFT: `ran_lora_config` adapts the attention projections and trains a classifier's new head in full;
a training step changes only those; a saved adapter reloads on a fresh base to identical logits; merging changes
nothing; generation runs through a LoRA causal LM; the training scripts take --lora_r and save an adapter."""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSequenceClassification
from transformers.utils import logging as transformers_logging

from ran_hf import (
    RAN_LORA_TARGET_MODULES,
    RANConfig,
    RANForCausalLM,
    RANForMaskedLM,
    frozen_new_weights,
    ran_lora_config,
)


peft = pytest.importorskip("peft")
from conftest import TINY_CONFIG  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForTokenClassification, AutoTokenizer  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "text-classification"))  # conftest puts the script folders on sys.path

import run_classification  # noqa: E402
import run_pipeline  # noqa: E402
import train_tokenizer  # noqa: E402


# A classifier from an encoder checkpoint (new pooler and classifier), the token classifier (new classifier), and
# the two language models from checkpoints of their own kind (nothing new).
HEADS = {
    "sequence-classification": (AutoModelForSequenceClassification, "encoder", {"num_labels": 3}),
    "token-classification": (AutoModelForTokenClassification, "encoder", {"num_labels": 5}),
    "masked-lm": (AutoModelForMaskedLM, "encoder", {}),
    "causal-lm": (AutoModelForCausalLM, "decoder", {}),
}
NEW_MODULES = {"sequence-classification": {"model.pooler", "classifier"}, "token-classification": {"classifier"}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """A pretrained-looking encoder (masked LM) and decoder (causal LM): random weights, saved."""
    folder = tmp_path_factory.mktemp("bases")
    torch.manual_seed(0)
    RANForMaskedLM(RANConfig(**TINY_CONFIG)).save_pretrained(folder / "encoder")
    RANForCausalLM(RANConfig(**TINY_CONFIG, is_causal=True)).save_pretrained(folder / "decoder")
    return {"encoder": folder / "encoder", "decoder": folder / "decoder"}


def load_base(checkpoints, head):
    auto_class, checkpoint, kwargs = HEADS[head]
    torch.manual_seed(1)  # new head modules start from the same random weights every time
    return auto_class.from_pretrained(checkpoints[checkpoint], output_loading_info=True, **kwargs)


def batch(head: str) -> dict:
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(1, TINY_CONFIG["vocab_size"], (3, 13), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    input_ids = input_ids * attention_mask
    if head == "sequence-classification":
        labels = torch.tensor([0, 2, 1])
    elif head == "token-classification":
        labels = torch.randint(0, 5, input_ids.shape, generator=generator)
    else:
        labels = input_ids.clone()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def train_steps(model, head: str, steps: int = 2) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        model(**batch(head)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def lora_model(checkpoints, head: str, r: int = 4):
    model, info = load_base(checkpoints, head)
    return get_peft_model(model, ran_lora_config(model, r=r, lora_alpha=8)), info


def test_the_target_modules_are_the_attention_projections():
    model = RANForMaskedLM(RANConfig(**TINY_CONFIG))
    adapted = get_peft_model(model, ran_lora_config(model, r=2))
    wrapped = {name.split(".")[-1] for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == set(RAN_LORA_TARGET_MODULES)
    layer_paths = {name for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert sum(".memory_review." in name for name in layer_paths) == 3 * TINY_CONFIG["num_hidden_layers"]
    assert sum(".memory_review." not in name for name in layer_paths) == 2 * TINY_CONFIG["num_hidden_layers"]


def test_a_lora_on_the_scans_own_glu_sends_the_fused_scan_back_to_the_reference(caplog):
    """The cell's GLU is the scan's own module (`layers.N.cell_scan.cell_glu`), matched by name suffix as any target
    module; the fused scan reads plain weights, so an adapter there runs the reference scan, which calls it."""
    transformers_logging.warning_once.cache_clear()
    torch.manual_seed(0)
    model = RANForMaskedLM(RANConfig(**TINY_CONFIG, scan_implementation="fused")).eval()
    # Non-zero adapters, so that skipping them would change the outputs.
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["cell_glu.proj"], init_lora_weights=False))
    wrapped = {name for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == {
        f"base_model.model.model.layers.{layer}.cell_scan.cell_glu.proj"
        for layer in range(TINY_CONFIG["num_hidden_layers"])
    }
    inputs = {name: value for name, value in batch("masked-lm").items() if name != "labels"}
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ran_hf.kernels.choice"):
        fused = adapted(**inputs).logits
        model.config.scan_implementation = "reference"
        reference = adapted(**inputs).logits
        with adapted.disable_adapter():
            without_adapters = adapted(**inputs).logits
    assert "`cell_glu.proj` is wrapped" in caplog.text
    torch.testing.assert_close(fused, reference, rtol=0, atol=0)
    assert not torch.allclose(fused, without_adapters)


@pytest.mark.parametrize("head", list(HEADS))
def test_a_step_changes_only_adapters_and_new_head_modules(checkpoints, head):
    model, info = lora_model(checkpoints, head)
    assert frozen_new_weights(model, info["missing_keys"]) == []
    before = {name: tensor.detach().clone() for name, tensor in model.named_parameters()}
    trainable = {name for name, tensor in model.named_parameters() if tensor.requires_grad}
    train_steps(model, head)
    changed = {name for name, tensor in model.named_parameters() if not torch.equal(tensor, before[name])}
    assert changed == trainable
    assert all(".lora_" in name or ".modules_to_save." in name for name in changed)
    trained_in_full = {name.split(".modules_to_save.")[0].removeprefix("base_model.model.") for name in changed}
    trained_in_full = {name for name in trained_in_full if ".lora_" not in name}
    assert trained_in_full == NEW_MODULES.get(head, set())


def test_a_plain_lora_config_leaves_the_new_pooler_frozen(checkpoints):
    """What PEFT does on its own: its SEQ_CLS task type saves `classifier`, not RAN's new pooler."""
    model, info = load_base(checkpoints, "sequence-classification")
    plain = get_peft_model(model, LoraConfig(r=4, target_modules=list(RAN_LORA_TARGET_MODULES), task_type="SEQ_CLS"))
    frozen = frozen_new_weights(plain, info["missing_keys"])
    assert frozen and all(name.startswith("model.pooler.") for name in frozen)
    assert set(frozen) == {key for key in info["missing_keys"] if key.startswith("model.pooler.")}


@pytest.mark.parametrize("head", ["sequence-classification", "causal-lm"])
def test_a_saved_adapter_reloads_to_identical_logits(checkpoints, head, tmp_path):
    model, _ = lora_model(checkpoints, head)
    train_steps(model, head)
    model.save_pretrained(tmp_path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {path.name for path in tmp_path.iterdir()}
    inputs = {name: value for name, value in batch(head).items() if name != "labels"}
    with torch.no_grad():
        expected = model(**inputs).logits
        torch.manual_seed(99)  # the fresh base's new head modules differ: the adapter must bring its own
        fresh, _ = HEADS[head][0].from_pretrained(
            checkpoints[HEADS[head][1]], output_loading_info=True, **HEADS[head][2]
        )
        reloaded = PeftModel.from_pretrained(fresh, tmp_path).eval()
        # Equal up to float rounding (measured: 1e-8 at logits of 0.05).
        torch.testing.assert_close(reloaded(**inputs).logits, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("head", list(HEADS))
def test_merged_model_equals_the_adapted_one(checkpoints, head):
    model, _ = lora_model(checkpoints, head)
    train_steps(model, head)
    inputs = {name: value for name, value in batch(head).items() if name != "labels"}
    with torch.no_grad():
        adapted = model(**inputs).logits
        merged = model.merge_and_unload()
        assert not isinstance(merged, PeftModel)
        torch.testing.assert_close(merged(**inputs).logits, adapted, rtol=0, atol=1e-5)


def test_generation_through_a_lora_causal_lm(checkpoints):
    model, _ = lora_model(checkpoints, "causal-lm")
    train_steps(model, "causal-lm", steps=3)
    prompt = batch("causal-lm")["input_ids"][:1, :7]
    settings = {"max_new_tokens": 9, "do_sample": False, "pad_token_id": 0}
    settings |= {"return_dict_in_generate": True, "output_scores": True}
    with torch.no_grad():
        adapted = model.generate(input_ids=prompt, **settings)
        with model.disable_adapter():
            unadapted = model.get_base_model().generate(input_ids=prompt, **settings)
        merged = model.merge_and_unload().generate(input_ids=prompt, **settings)
    assert adapted.sequences.shape == (1, 16)
    assert torch.equal(adapted.sequences, merged.sequences)
    torch.testing.assert_close(torch.stack(adapted.scores), torch.stack(merged.scores), rtol=0, atol=1e-5)
    # The adapter takes part in every decoding step: its scores are not the base model's.
    assert (torch.stack(adapted.scores) - torch.stack(unadapted.scores)).abs().max() > 1e-3


# ---- the training scripts ------------------------------------------------------------------------------------------


def test_run_classification_with_lora_saves_an_adapter_that_reloads(checkpoints, tmp_path):
    files = run_pipeline.write_topic_documents(tmp_path / "data", {"train": 12, "validation": 4}, seed=3)
    tokenizer_dir = tmp_path / "tokenizer"
    train_tokenizer.main(
        ["--train_files", str(files["train"]), "--vocab_size", str(TINY_CONFIG["vocab_size"])]
        + ["--output_dir", str(tokenizer_dir)]
    )
    output_dir = tmp_path / "adapter"
    results = run_classification.main(
        ["--model_name_or_path", str(checkpoints["encoder"]), "--tokenizer_name", str(tokenizer_dir)]
        + ["--train_file", str(files["train"]), "--validation_file", str(files["validation"])]
        + ["--max_seq_length", "64", "--do_train", "--do_eval", "--max_steps", "2", "--learning_rate", "1e-2"]
        + ["--per_device_train_batch_size", "4", "--output_dir", str(output_dir), "--lora_r", "4"]
        + ["--report_to", "none", "--disable_tqdm", "true", "--log_level", "warning", "--use_cpu"]
    )
    names = {path.name for path in output_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json"} <= names
    assert "model.safetensors" not in names
    adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and set(adapter_config["target_modules"]) == set(RAN_LORA_TARGET_MODULES)
    assert set(adapter_config["modules_to_save"]) >= {"pooler", "classifier"}
    card = (output_dir / "README.md").read_text()
    assert "LoRA adapter" in card and "PeftModel.from_pretrained" in card
    assert ModelCard.load(output_dir / "README.md").data.library_name == "peft"

    labels = results["labels"]
    base = AutoModelForSequenceClassification.from_pretrained(
        checkpoints["encoder"], num_labels=len(labels), id2label=dict(enumerate(labels))
    )
    reloaded = PeftModel.from_pretrained(base, output_dir).eval()
    # The reloaded adapter gives the evaluation loss the run reported (one batch of 4 validation documents).
    documents = [json.loads(line) for line in files["validation"].open()]
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    texts = [document["text"] for document in documents]
    inputs = tokenizer(texts, truncation=True, max_length=64, padding=True, return_tensors="pt")
    with torch.no_grad():
        loss = reloaded(**inputs, labels=torch.tensor([labels.index(d["label"]) for d in documents])).loss
    reported = json.loads((output_dir / "eval_results.json").read_text())["eval_loss"]
    assert loss.item() == pytest.approx(reported, abs=1e-5)


def test_lora_needs_a_pretrained_model():
    from training_utils import ModelArguments

    with pytest.raises(ValueError, match="--model_name_or_path"):
        ModelArguments(tokenizer_name="tok", lora_r=4)
