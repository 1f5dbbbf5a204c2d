"""A saved folder's code never shadows a library: loaded with the folder itself as the working directory (and so on
`sys.path`, as `cd my-model && python -c ...` has it), every head loads without `ran_hf`; and no module a folder
ships has the name of a top-level module Python could import from this environment (`kernels`, `triton`, ...)."""

import json
import subprocess
import sys

import pytest
from ran_testing import tiny_config
from remote_code import BLOCK_RAN_HF, PRINT_REPORT

from ran_hf import (
    RANForCausalLM,
    RANForMaskedLM,
    RANForQuestionAnswering,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
)


HEADS = {
    "AutoModel": (RANModel, {}),
    "AutoModelForMaskedLM": (RANForMaskedLM, {}),
    "AutoModelForSequenceClassification": (RANForSequenceClassification, {"num_labels": 3}),
    "AutoModelForTokenClassification": (RANForTokenClassification, {"num_labels": 3}),
    "AutoModelForQuestionAnswering": (RANForQuestionAnswering, {}),
    "AutoModelForCausalLM": (RANForCausalLM, {"is_causal": True}),
}

LOAD_HERE = r"""
import transformers
from transformers.utils.import_utils import is_kernels_available
report["kernels_available"] = is_kernels_available()  # what imported a folder's `kernels.py` as the library
model = getattr(transformers, AUTO_CLASS).from_pretrained(".", trust_remote_code=True)
report["loaded"] = type(model).__name__
"""


@pytest.fixture(scope="module")
def saved_folders(tmp_path_factory):
    folders = {}
    for auto_class, (model_class, fields) in HEADS.items():
        folder = tmp_path_factory.mktemp(auto_class)
        model_class(tiny_config(**fields)).save_pretrained(folder)
        folders[auto_class] = folder
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("auto_class", list(HEADS))
def test_every_head_loads_with_its_folder_as_the_working_directory(saved_folders, auto_class, tmp_path):
    script = BLOCK_RAN_HF + f"AUTO_CLASS = {auto_class!r}\n" + LOAD_HERE + PRINT_REPORT
    completed = subprocess.run(
        [sys.executable, "-c", script],  # `-c`: the working directory, the folder, is first on `sys.path`
        cwd=saved_folders[auto_class],
        env={"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["loaded"] == HEADS[auto_class][0].__name__ and not report["ran_hf_imported"]


def test_no_shipped_module_has_the_name_of_an_importable_module(saved_folders, tmp_path):
    shipped = sorted({file.stem for folder in saved_folders.values() for file in folder.glob("*.py")})
    assert "modeling_ran" in shipped and "configuration_ran" in shipped
    # In a fresh interpreter that sees neither a folder nor the working directory (-I), with `ran_hf` itself blocked:
    # what it could import under a shipped module's name is a library a folder on `sys.path` would shadow.
    script = BLOCK_RAN_HF + f"import importlib.util\nreport['found'] = [name for name in {shipped!r} " + (
        "if importlib.util.find_spec(name) is not None]\n"
    ) + PRINT_REPORT  # fmt: skip
    completed = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(completed.stdout.strip().splitlines()[-1])["found"] == []
