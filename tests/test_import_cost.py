"""`import ran_hf` stays cheap: it imports the configuration and nothing heavy (no models, pipelines, Triton, ONNX,
PEFT or sentence-transformers), while every public name still resolves, the Auto classes load RAN models, and the
`extractive-question-answering` task is registered whenever `transformers.pipelines` is imported, before or after.

Each check runs in a fresh interpreter (this one imported everything long ago). No timing is asserted here: the
time is measured in benchmarks/import/.
"""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ran_hf


# Modules that `import ran_hf` must leave unimported. `transformers.modeling_utils` (which the models import) costs
# about as much as Transformers itself, and imports Triton and `torch.onnx` where they are installed.
HEAVY_MODULES = (
    "transformers.modeling_utils",
    "transformers.pipelines",
    "triton",
    "onnx",
    "onnxscript",
    "onnxruntime",
    "torch.onnx",
    "sentence_transformers",
    "peft",
)


def run_fresh(script: str) -> dict:
    """Run `script` in a new interpreter; it prints one JSON object last, returned."""
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_import_ran_hf_imports_nothing_heavy_and_registers_on_first_use():
    report = run_fresh(
        f"""
import json, sys
import ran_hf
report = {{"heavy": [name for name in {HEAVY_MODULES!r} if name in sys.modules]}}
report["ran_hf_modules"] = sorted(name for name in sys.modules if name.startswith("ran_hf"))

# The kernels' mapping imports no Triton: the Triton kernels (kernels/triton_ops) are imported when one is chosen.
import ran_hf.kernels
report["triton_after_kernels"] = "triton" in sys.modules

# The pipeline's task is registered once anything imports the pipelines.
from transformers import pipeline
from transformers.pipelines import PIPELINE_REGISTRY
task = PIPELINE_REGISTRY.supported_tasks.get("extractive-question-answering")
report["pipeline"] = task and task["impl"].__module__ + "." + task["impl"].__name__

# The Auto classes load RAN models (and then hold the models' own classes).
from transformers import AutoModelForMaskedLM
config = ran_hf.RANConfig(vocab_size=31, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                          window_size=8, min_window_size=2)
model = AutoModelForMaskedLM.from_config(config)
model(input_ids=__import__("torch").ones(1, 5, dtype=__import__("torch").long))
report["triton_ops_after_a_cpu_forward"] = [name for name in sys.modules if name.startswith("ran_hf.kernels.triton")]
report["model"] = type(model) is ran_hf.RANForMaskedLM
report["mapping"] = AutoModelForMaskedLM._model_mapping[type(config)] is ran_hf.RANForMaskedLM
report["remote_code"] = ran_hf.RANForMaskedLM.is_remote_code()  # installed, not remote code: the config ships it
print(json.dumps(report))
"""
    )
    assert report["heavy"] == []
    # (the config saves through `files.safe_writes`: the standard library and Transformers' logging)
    modules = [
        "ran_hf",
        "ran_hf.configuration_ran",
        "ran_hf.files",
        "ran_hf.files.safe_writes",
        "ran_hf.files.saved_code",
    ]
    assert report["ran_hf_modules"] == modules
    assert not report["triton_after_kernels"]
    assert report["triton_ops_after_a_cpu_forward"] == []
    assert report["pipeline"] == "ran_hf.integrations.question_answering.ExtractiveQuestionAnsweringPipeline"
    assert report["model"] and report["mapping"]
    assert report["remote_code"] is False


@pytest.mark.parametrize(
    "imports",
    [
        pytest.param("import transformers.pipelines\nimport ran_hf", id="pipelines-before-ran_hf"),
        pytest.param("from ran_hf import ExtractiveQuestionAnsweringPipeline", id="pipeline-class-first"),
    ],
)
def test_the_pipeline_task_is_registered_whichever_is_imported_first(imports):
    report = run_fresh(
        f"""
import json
{imports}
import transformers.pipelines
task = transformers.pipelines.PIPELINE_REGISTRY.supported_tasks.get("extractive-question-answering")
print(json.dumps({{"pipeline": task and task["impl"].__name__}}))
"""
    )
    assert report["pipeline"] == "ExtractiveQuestionAnsweringPipeline"


def test_every_public_name_resolves_to_its_module():
    assert set(ran_hf.__all__) <= set(dir(ran_hf))
    for name in ran_hf.__all__:
        value = getattr(ran_hf, name)
        module = ran_hf._LAZY_NAMES.get(name, "configuration_ran")
        assert value is getattr(importlib.import_module(f"ran_hf.{module}"), name), name


def test_the_triton_kernels_are_defined_at_the_top_of_their_modules():
    """`triton.jit` kernels and the `triton_op`s that launch them sit at the top of their modules (where readers,
    linters and tracebacks find them, and `triton.jit` a kernel's helpers), in `ran_hf/kernels/triton_ops/` only."""
    package = Path(ran_hf.__file__).parent
    kernels = []
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            decorators = getattr(node, "decorator_list", [])
            if any(ast.unparse(decorator).startswith(("triton.jit", "triton_op")) for decorator in decorators):
                assert node in tree.body, f"{path.name}: {node.name} is defined inside another definition"
                assert path.parent.name == "triton_ops", f"{path}: {node.name} outside kernels/triton_ops"
                kernels.append(node.name)
    assert {"_project_kernel", "_attention_grad_kernel", "_norm_forward_kernel", "scan_project", "glu_forward"} <= set(
        kernels
    )


def test_a_stand_in_pickles_as_its_model_class_before_first_use():
    """Pickling what an Auto class holds for RAN before the models were imported (a DataLoader worker, a process
    pool) failed: pickle found the real class under the stand-in's name ("not the same object")."""
    script = (
        "import pickle, sys, ran_hf\n"
        "from transformers import AutoModelForCausalLM\n"
        "stand_in = AutoModelForCausalLM._model_mapping[ran_hf.RANConfig]\n"
        "assert 'ran_hf.modeling_ran' not in sys.modules\n"
        "print(pickle.loads(pickle.dumps(stand_in)) is ran_hf.RANForCausalLM)\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "True"
