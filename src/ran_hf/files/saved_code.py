"""The code a saved RAN folder ships, so that it loads with any Auto class and `trust_remote_code=True` without
`ran_hf`: the `auto_map` naming every head's class, the question-answering pipeline a folder serves, and the copying
of the modules.

A folder holds its code flat, as Transformers' remote-code loader reads it (it follows `from .module import` only):
the model's modules, and the three of `files/` the model imports (this one, the guarded writes `safe_writes.py` and
the weights files' reader `weight_files.py`), copied beside them with the imports that name `files.` made flat. They
import each other only, so they run either way.
"""

import os
import re
from pathlib import Path

from .safe_writes import write_into


_HERE = Path(__file__).parent
# The model's modules: beside this one in a saved folder (which holds `configuration_ran.py`), above it in the package.
MODEL_DIR = _HERE if (_HERE / "configuration_ran.py").is_file() else _HERE.parent
# Where a module a folder ships may sit: with the model, in `files/` (those three), in `integrations/` (the pipeline).
_PLACES = (MODEL_DIR, MODEL_DIR / "files", MODEL_DIR / "integrations")
_RELATIVE_IMPORT = re.compile(r"^(\s*from\s+\.)(files\.)?(\w+)(\s+import)", flags=re.MULTILINE)

_HEADS = ("CausalLM", "MaskedLM", "QuestionAnswering", "SequenceClassification", "TokenClassification")
REMOTE_CODE_AUTO_MAP = {"AutoConfig": "configuration_ran.RANConfig", "AutoModel": "modeling_ran.RANModel"}
REMOTE_CODE_AUTO_MAP |= {f"AutoModelFor{head}": f"modeling_ran.RANFor{head}" for head in _HEADS}
# The prefix LM is the model behind AutoModelForSeq2SeqLM, as `import ran_hf` registers it: a masked LM's folder, or a
# converted checkpoint, loads as one (docs/seq2seq.md). A copy of this code loaded from a folder has prefix_lm.py only
# if it ran it, and names only what it can ship.
if (MODEL_DIR / "prefix_lm.py").is_file():
    REMOTE_CODE_AUTO_MAP["AutoModelForSeq2SeqLM"] = "prefix_lm.RANForPrefixLM"
# The pipeline a question-answering model's folder ships and names in `custom_pipelines`, so that
# `pipeline(QUESTION_ANSWERING_TASK, model=folder, trust_remote_code=True)` runs without `ran_hf`.
QUESTION_ANSWERING_TASK = "extractive-question-answering"
QUESTION_ANSWERING_PIPELINE = {
    "impl": "question_answering.ExtractiveQuestionAnsweringPipeline",
    "pt": ["AutoModelForQuestionAnswering"],
    "type": "text",
}


def _source(module: str) -> Path | None:
    """The file of `module` a saved folder ships (in a copy loaded from a folder: one Transformers fetched), or None."""
    return next((place / f"{module}.py" for place in _PLACES if (place / f"{module}.py").is_file()), None)


def flat_code(module: str) -> dict[str, str]:
    """`module`'s source and that of every module it imports relatively, by file name, with the imports made flat."""
    code, todo = {}, [module]
    while todo:
        name = todo.pop()
        if f"{name}.py" in code or (source := _source(name)) is None:
            continue
        text = source.read_bytes().decode("utf-8")  # (bytes: line endings kept as they are)
        todo += [match[2] for match in _RELATIVE_IMPORT.findall(text)]
        code[f"{name}.py"] = _RELATIVE_IMPORT.sub(r"\1\3\4", text)
    return code


def kept_pipelines(config, pipelines: dict | None) -> dict:
    """The `custom_pipelines` a loaded config keeps: not those of the tasks `import ran_hf` registered
    (`config.tasks_registered_here`), which the registered pipeline serves in this process."""
    return {task: info for task, info in (pipelines or {}).items() if task not in config.tasks_registered_here}


def served_pipelines(config) -> dict:
    """The `custom_pipelines` a saved config names: they follow from its model, as its `auto_map` does."""
    if "RANForQuestionAnswering" in (config.architectures or ()) and _source("question_answering"):
        return {QUESTION_ANSWERING_TASK: dict(QUESTION_ANSWERING_PIPELINE)}
    return {}


def save_code(config, save_directory: str | os.PathLike) -> None:
    """`RANConfig.save_pretrained`: write the code of every module the config names (with a model, `architectures`
    set: the `auto_map`'s models and the pipeline of `custom_pipelines`; a config alone: its own, which AutoConfig
    loads) with the modules each imports, flat."""
    if os.path.isfile(save_directory):
        return
    named = [config.auto_map["AutoConfig"]]
    if config.architectures:
        named += [reference for reference in config.auto_map.values() if isinstance(reference, str)]
        named += [info["impl"] for info in served_pipelines(config).values()]
    code = {}
    for module in sorted({reference.split("--")[-1].split(".")[0] for reference in named}):
        code |= flat_code(module)  # a copy of this code loaded from a folder has only the modules it ran
    with write_into(save_directory) as staging:  # safe_writes.py: a module's name linked elsewhere is not followed
        for file_name, text in code.items():
            (staging / file_name).write_bytes(text.encode("utf-8"))
