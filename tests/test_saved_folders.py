"""A folder saved from any RAN head carries the modeling code and nothing else (no kernel), and serves on its own: with
`ran_hf` unimportable (see `remote_code.py`), every Auto class loads it with `trust_remote_code=True` and runs the plain
PyTorch implementations, and a question-answering model's folder serves the `extractive-question-answering` pipeline,
with the answers of the installed package. Where `ran_hf` is installed, the folder's code takes its kernels from it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ran_testing import tiny_config
from remote_code import run_without_ran_hf
from test_save_load import CONVERSION, OLD_CELL_WEIGHT, TODAYS_CELL_WEIGHT, saved_weight_names, with_old_weight_names
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, pipeline

import ran_hf
import ran_hf.kernels


PACKAGE = Path(ran_hf.__file__).parent
# Flat modules that are no model's code (the package's registrations): no saved folder carries them. The integrations
# (ONNX export, checkpoint conversion, PEFT and sentence-transformers glue) and the file readers and writers sit in the
# `integrations` and `files` subpackages, which no folder carries either.
NOT_MODEL_CODE = {"__init__"}
SUBPACKAGE_CODE = {path.stem for folder in ("files", "integrations") for path in (PACKAGE / folder).glob("*.py")}
# What every folder carries from `files/`, flat: the guarded writes, the shipped-code list and the weights files' reader,
# which the config and the model base import.
SHIPPED_FROM_FILES = {"safe_writes", "saved_code", "weight_files"}
# The fused and Triton implementations: a folder's code takes them from an installed `ran_hf`, and never ships them.
KERNEL_CODE = {path.read_text() for path in (PACKAGE / "kernels").rglob("*.py")}
# Code that only the folder of one head carries: its pipeline, from `integrations/`, copied flat. Every folder carries
# the package's flat modules (the prefix LM's too: every folder loads with AutoModelForSeq2SeqLM).
HEAD_CODE = {"RANForQuestionAnswering": {"question_answering"}}
# Each head, the Auto class that loads it, and the output compared.
HEADS = {
    "RANModel": ("AutoModel", "last_hidden_state"),
    "RANForMaskedLM": ("AutoModelForMaskedLM", "logits"),
    "RANForSequenceClassification": ("AutoModelForSequenceClassification", "logits"),
    "RANForTokenClassification": ("AutoModelForTokenClassification", "logits"),
    "RANForQuestionAnswering": ("AutoModelForQuestionAnswering", "start_logits"),
    "RANForCausalLM": ("AutoModelForCausalLM", "logits"),
    "RANForPrefixLM": ("AutoModelForSeq2SeqLM", "logits"),
}


def saved_head(name: str, folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(ran_hf, name)(tiny_config(is_causal=name == "RANForCausalLM", window_overlap=1)).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", HEADS)
def test_a_saved_folder_carries_the_modeling_code_only(name, tmp_path):
    saved_head(name, tmp_path)
    shipped = {path.stem for path in tmp_path.glob("*.py")}
    package = {path.stem for path in PACKAGE.glob("*.py")}
    own_code = HEAD_CODE.get(name, set())
    assert not shipped & NOT_MODEL_CODE
    assert not shipped & (SUBPACKAGE_CODE - {"__init__"} - own_code - SHIPPED_FROM_FILES)
    assert not (tmp_path / "files").exists() and not (tmp_path / "integrations").exists()
    assert not {path.read_text() for path in tmp_path.glob("*.py")} & KERNEL_CODE
    assert not [path for path in tmp_path.rglob("*") if path.is_dir()]  # flat: no folder of code at all
    assert {"building_blocks", "cell_scan", "kernel_hub", "scan_inputs"} <= shipped  # the plain implementations
    assert shipped == package - NOT_MODEL_CODE | own_code | SHIPPED_FROM_FILES
    assert not [path for path in tmp_path.glob("*.py") if "from .files." in path.read_text()]  # imports made flat
    config = json.loads((tmp_path / "config.json").read_text())
    for reference in config["auto_map"].values():  # every class the config names is in the folder
        assert reference.split(".")[0] in shipped, reference
    assert ("custom_pipelines" in config) == (name == "RANForQuestionAnswering")


# Runs where `ran_hf` cannot be imported: loads each folder with its Auto class (and the encoder's with a head's), and
# reports the largest difference from the outputs the parent saved; saves each model again. A copy under the weight
# names of a checkpoint saved while the cell's GLU and norm were the layer's is refused by the shipped code: the error.
LOAD_EACH_HEAD = r"""
import torch
import transformers

root = sys.argv[1]
expected = torch.load(f"{root}/expected.pt")
report["differences"], report["modules"], report["loading_info"], report["refused"] = {}, {}, {}, {}
report["kernels"] = {}
for name, (auto_class, output) in json.loads(sys.argv[2]).items():
    model, info = getattr(transformers, auto_class).from_pretrained(
        f"{root}/{name}", trust_remote_code=True, output_loading_info=True
    )
    with torch.no_grad():
        inputs = {"input_ids": expected["input_ids"], "attention_mask": expected["attention_mask"]}
        actual = getattr(model.eval()(**inputs), output)
    report["differences"][name] = (actual - expected[name]).abs().max().item()
    report["modules"][name] = type(model).__module__ + "." + type(model).__name__
    report["kernels"][name] = sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".kernel_hub"].KERNELS
    report["loading_info"][name] = {key: sorted(map(str, value)) for key, value in info.items()}
    if name == "RANForMaskedLM":
        report["masked_lm_decoder_tied"] = model.decoder.weight is model.get_input_embeddings().weight
    model.save_pretrained(f"{root}/{name}-resaved")
    try:
        getattr(transformers, auto_class).from_pretrained(f"{root}/{name}-old-names", trust_remote_code=True)
    except ValueError as error:
        report["refused"][name] = str(error)
# A folder saved from the encoder loads with any head's Auto class (its config names them all).
classifier = transformers.AutoModelForSequenceClassification.from_pretrained(
    f"{root}/RANModel", trust_remote_code=True
)
report["encoder_as_classifier"] = type(classifier).__name__
"""


@pytest.mark.slow
def test_every_saved_head_loads_and_runs_without_ran_hf(tmp_path):
    input_ids = torch.randint(1, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # left padding
    expected = {"input_ids": input_ids, "attention_mask": attention_mask}
    for name, (_, output) in HEADS.items():
        model = saved_head(name, tmp_path / name)
        # Without `ran_hf` the folder runs the plain PyTorch implementations; here the fused scan would run ("auto").
        model.config.scan_implementation = "reference"
        with torch.no_grad():
            expected[name] = getattr(model(input_ids=input_ids, attention_mask=attention_mask), output)
        shutil.copytree(tmp_path / name, tmp_path / f"{name}-old-names")
        with_old_weight_names(tmp_path / f"{name}-old-names")
    torch.save(expected, tmp_path / "expected.pt")

    report = run_without_ran_hf(LOAD_EACH_HEAD, [tmp_path, json.dumps(HEADS)], tmp_path)
    assert len(report["modules"]) == len(HEADS)
    assert report["kernels"] == dict.fromkeys(HEADS, {})  # nothing attached: plain PyTorch
    for name, module in report["modules"].items():
        assert module.startswith("transformers_modules.") and module.endswith(f".{name}"), module
    for name, difference in report["differences"].items():
        assert difference <= 1e-6, f"{name} differs by {difference}"
        assert not any(report["loading_info"][name].values()), (name, report["loading_info"][name])
    assert report["masked_lm_decoder_tied"]
    assert report["refused"].keys() == HEADS.keys()  # old names: refused, naming one and the conversion
    for name, error in report["refused"].items():
        assert "layers.0.cell_glu.proj.bias" in error and CONVERSION in error, error
    for name in HEADS:  # saved again by the remote code, under today's names
        resaved = saved_weight_names(tmp_path / f"{name}-resaved")
        assert resaved == saved_weight_names(tmp_path / name), name
        assert any(map(TODAYS_CELL_WEIGHT.search, resaved)) and not any(map(OLD_CELL_WEIGHT.search, resaved))
    assert report["encoder_as_classifier"] == "RANForSequenceClassification"


# Runs where `ran_hf` is installed: a folder's code attaches the installed package's kernels (the fused scan, in float32
# inference on a CPU), and gives the installed package's outputs.
LOAD_WITH_RAN_HF = r"""
import json, sys
import torch
import transformers

root = sys.argv[1]
expected = torch.load(f"{root}/expected.pt")
# (`ran_hf` not imported first: where it is, its registered classes load the folder, not the folder's code)
model = transformers.AutoModel.from_pretrained(f"{root}/RANModel", trust_remote_code=True).eval()
from ran_hf.kernels import choice  # imported by the folder's code: the package the folder's kernels come from

choice.CHOSEN.clear()
with torch.no_grad():
    hidden = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).last_hidden_state
package = sys.modules[type(model).__module__.rsplit(".", 1)[0]]
norm = getattr(sys.modules[package.__name__ + ".building_blocks"], "RANCenteredRMSNorm")
print(json.dumps({
    "module": type(model).__module__, "kernel_layer_name": norm.__dict__.get("kernel_layer_name"),
    "attached": sorted(sys.modules[package.__name__ + ".kernel_hub"].KERNELS), "chosen": choice.CHOSEN,
    "difference": (hidden - expected["RANModel"]).abs().max().item(),
}))
"""


@pytest.mark.slow
def test_a_saved_folder_takes_its_kernels_from_the_installed_package(tmp_path):
    input_ids = torch.randint(1, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    model = saved_head("RANModel", tmp_path / "RANModel")
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).last_hidden_state
    torch.save({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "RANModel": expected},
               tmp_path / "expected.pt")  # fmt: skip
    completed = subprocess.run(
        [sys.executable, "-c", LOAD_WITH_RAN_HF, str(tmp_path)],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["module"].startswith("transformers_modules.")
    assert report["kernel_layer_name"] == "RANCenteredRMSNorm"
    assert report["attached"] == sorted(ran_hf.kernels.KERNELS)
    assert report["chosen"]["scan"] == "fused"
    assert report["difference"] <= 1e-6


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A fast BERT-style tokenizer over a handful of words ([CLS] question [SEP] context [SEP]), with offsets."""
    words = "who wrote the report alice bob carol said that it was written by in march".split()
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    special = {
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
    }
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)


QUESTION = "who wrote the report"
CONTEXT = "bob said that the report was written in march by alice and carol"

ANSWER_WITH_THE_FOLDER = r"""
from transformers import pipeline

answer_finder = pipeline("extractive-question-answering", model=sys.argv[1], trust_remote_code=True)
report["answers"] = answer_finder(question=sys.argv[2], context=sys.argv[3], top_k=3)
report["pipeline"] = type(answer_finder).__module__ + "." + type(answer_finder).__name__
"""


@pytest.mark.slow
def test_a_question_answering_folder_serves_its_pipeline_without_ran_hf(tmp_path):
    tokenizer = word_tokenizer()
    folder = tmp_path / "qa"
    saved_head("RANForQuestionAnswering", folder)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["custom_pipelines"]["extractive-question-answering"]["impl"] == (
        "question_answering.ExtractiveQuestionAnsweringPipeline"
    )
    # In this process the installed package's pipeline serves the task, without `trust_remote_code`.
    answer_finder = pipeline("extractive-question-answering", model=str(folder))
    assert type(answer_finder) is ran_hf.ExtractiveQuestionAnsweringPipeline
    expected = answer_finder(question=QUESTION, context=CONTEXT, top_k=3)

    report = run_without_ran_hf(ANSWER_WITH_THE_FOLDER, [folder, QUESTION, CONTEXT], tmp_path)
    assert report["pipeline"].startswith("transformers_modules.")
    assert report["pipeline"].endswith(".question_answering.ExtractiveQuestionAnsweringPipeline")
    assert [(a["start"], a["end"], a["answer"]) for a in report["answers"]] == [
        (a["start"], a["end"], a["answer"]) for a in expected
    ]
    assert [a["score"] for a in report["answers"]] == pytest.approx([a["score"] for a in expected], abs=1e-6)


LOAD_CONFIG = r"""
import transformers

config = transformers.AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
report["loaded"] = type(config).__name__
report["hidden_size"] = config.hidden_size
"""


def test_a_config_saved_alone_carries_its_own_code_and_loads_without_ran_hf(tmp_path):
    ran_hf.RANConfig(hidden_size=48, num_attention_heads=3, head_dim=16).save_pretrained(tmp_path / "config")
    shipped = {path.name for path in (tmp_path / "config").glob("*.py")}
    assert shipped == {"configuration_ran.py", "safe_writes.py", "saved_code.py"}  # its own, not the models'
    report = run_without_ran_hf(LOAD_CONFIG, [tmp_path / "config"], tmp_path)
    assert report["loaded"] == "RANConfig" and report["hidden_size"] == 48 and not report["ran_hf_imported"]
