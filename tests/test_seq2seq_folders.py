"""docs/seq2seq.md says a converted `rannet` checkpoint loads as `RANForPrefixLM`, which `AutoModelForSeq2SeqLM`
loads for a RAN config. Without `ran_hf` that holds only if the folder's `auto_map` names the prefix LM and the
folder ships its code: every saved folder does (a masked LM's, the converter's). The converter's command line names
its own flag when it refuses a folder that is not empty."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ran_testing import randomize_, tiny_config
from remote_code import run_without_ran_hf

from ran_hf import RANForMaskedLM, RANForPrefixLM, convert_rannet_checkpoint
from ran_hf.integrations.convert_rannet import OutputFolderNotEmptyError


ROOT = Path(__file__).resolve().parents[1]
CONVERTER = ROOT / "scripts" / "convert_rannet_checkpoint.py"
SEQ2SEQ_FIXTURE = ROOT / "tests" / "fixtures" / "rannet" / "seq2seq_l2_d24_w6"
TOLERANCE = 1e-4  # against rannet (float32 TensorFlow), as in test_prefix_lm.py

# Where `ran_hf` cannot be imported: each folder through AutoModelForSeq2SeqLM, its logits for the given cases.
SEQ2SEQ_WITHOUT_RAN_HF = r"""
import torch
from transformers import AutoModelForSeq2SeqLM

report["classes"], report["logits"] = {}, {}
for folder in sys.argv[2:]:
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    report["classes"][folder] = type(model).__module__ + "." + type(model).__name__
    with torch.no_grad():
        report["logits"][folder] = [
            model(torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0].tolist()
            for ids, types in json.loads(sys.argv[1])
        ]
"""


def converter(*args: str) -> subprocess.CompletedProcess:
    """scripts/convert_rannet_checkpoint.py run as a user runs it."""
    command = [sys.executable, str(CONVERTER), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)


def test_every_saved_folder_names_the_prefix_lm_for_seq2seq(tmp_path):
    """The `auto_map` of a masked LM's folder names the prefix LM for AutoModelForSeq2SeqLM, and the folder holds
    the module it names."""
    RANForMaskedLM(tiny_config()).save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForSeq2SeqLM"] == "prefix_lm.RANForPrefixLM"
    assert (tmp_path / "prefix_lm.py").is_file()


@pytest.mark.slow
def test_a_masked_lm_and_a_converted_checkpoint_load_as_seq2seq_without_ran_hf(tmp_path):
    """Both folders load through AutoModelForSeq2SeqLM with `trust_remote_code=True` where `ran_hf` cannot be
    imported, as the shipped RANForPrefixLM: the masked LM's gives the installed prefix LM's logits, the converted
    checkpoint (written by the converter's command line) `RanNetForSeq2Seq`'s."""
    masked = tmp_path / "masked-lm"
    randomize_(RANForMaskedLM(tiny_config(window_overlap=1)), seed=3).save_pretrained(masked)
    converted = tmp_path / "converted"
    completed = converter("--rannet_dir", SEQ2SEQ_FIXTURE, "--output_dir", converted)
    assert completed.returncode == 0, completed.stderr

    with np.load(SEQ2SEQ_FIXTURE / "expected.npz") as arrays:
        expected = {key: torch.from_numpy(arrays[key]) for key in arrays.files}
    offsets = expected["offsets"].tolist()
    cases = [
        (expected["input_ids"][a:b].tolist(), expected["token_type_ids"][a:b].tolist(), slice(a, b))
        for a, b in zip(offsets[:-1], offsets[1:])
    ]
    inputs = [(ids, types) for ids, types, _ in cases]
    report = run_without_ran_hf(SEQ2SEQ_WITHOUT_RAN_HF, [json.dumps(inputs), masked, converted], tmp_path)

    for folder in (masked, converted):
        module = report["classes"][str(folder)]
        assert module.startswith("transformers_modules.") and module.endswith(".prefix_lm.RANForPrefixLM"), module
    # The plain PyTorch scan, which the folder runs without `ran_hf` (the installed package's "auto" is its fused one).
    installed = RANForPrefixLM.from_pretrained(masked, scan_implementation="reference").eval()
    for (ids, types), logits in zip(inputs, report["logits"][str(masked)]):
        with torch.no_grad():
            reference = installed(torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0]
        assert (torch.tensor(logits) - reference).abs().max() <= 1e-6
    for (_, _, tokens), logits in zip(cases, report["logits"][str(converted)]):
        assert (torch.tensor(logits) - expected["mlm_logits"][tokens]).abs().max() <= TOLERANCE


def test_a_folder_that_is_not_empty_is_refused_naming_the_callers_way_to_replace_it(tmp_path):
    """From Python the fix is the argument `overwrite=True`; from the command line it is the flag `--overwrite`,
    which the script's error names instead. With the flag the conversion replaces the model and keeps other files."""
    output = tmp_path / "converted"
    output.mkdir()
    (output / "notes.txt").write_text("keep me")
    with pytest.raises(OutputFolderNotEmptyError, match=r"exists and is not empty; pass overwrite=True") as error:
        convert_rannet_checkpoint(SEQ2SEQ_FIXTURE, output)
    assert isinstance(error.value, FileExistsError) and "--overwrite" not in str(error.value)

    refused = converter("--rannet_dir", SEQ2SEQ_FIXTURE, "--output_dir", output)
    assert refused.returncode == 1
    assert f"error: {output} exists and is not empty; add --overwrite to replace the model" in refused.stderr
    assert "overwrite=True" not in refused.stderr and not (output / "model.safetensors").exists()

    replaced = converter("--rannet_dir", SEQ2SEQ_FIXTURE, "--output_dir", output, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert (output / "model.safetensors").is_file() and (output / "notes.txt").read_text() == "keep me"
