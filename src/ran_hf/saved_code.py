"""The code a saved RAN folder ships, so that it loads with any Auto class and `trust_remote_code=True` without
`ran_hf`: the `auto_map` naming every head's class, the question-answering pipeline a folder serves, and the copying
of the modules. Saved folders ship this module too (the config imports it), so it imports sibling modules only."""

import os
import shutil
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files

from .safe_writes import write_into


_HEADS = ("CausalLM", "MaskedLM", "QuestionAnswering", "SequenceClassification", "TokenClassification")
REMOTE_CODE_AUTO_MAP = {"AutoConfig": "configuration_ran.RANConfig", "AutoModel": "modeling_ran.RANModel"}
REMOTE_CODE_AUTO_MAP |= {f"AutoModelFor{head}": f"modeling_ran.RANFor{head}" for head in _HEADS}
# The prefix LM is the model behind AutoModelForSeq2SeqLM, as `import ran_hf` registers it: a masked LM's folder, or a
# converted checkpoint, loads as one (docs/seq2seq.md). A copy of this code loaded from a folder has prefix_lm.py only
# if it ran it, and names only what it can ship.
if Path(__file__).with_name("prefix_lm.py").is_file():
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
    """The file of `module` that a saved folder ships: beside this one (the model's modules; in a copy loaded from a
    saved folder, every module Transformers fetched) or in the package's `integrations/` (the pipeline, which has no
    relative import and is copied flat). None where neither has it."""
    for source in (Path(__file__).with_name(f"{module}.py"), Path(__file__).parent / "integrations" / f"{module}.py"):
        if source.is_file():
            return source
    return None


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
    """`RANConfig.save_pretrained`: with a model (`architectures` set), write the code of every module the config
    names (the `auto_map`'s models, the pipeline of `custom_pipelines`) with the sibling modules each imports."""
    if not config.architectures or os.path.isfile(save_directory):
        return
    named = [reference for reference in config.auto_map.values() if isinstance(reference, str)]
    named += [info["impl"] for info in served_pipelines(config).values()]
    with write_into(save_directory) as staging:  # safe_writes.py: a module's name linked elsewhere is not followed
        for module in sorted({reference.split("--")[-1].split(".")[0] for reference in named}):
            if source := _source(module):  # a copy of this code loaded from a folder has only the modules it ran
                for file in (source, *map(Path, get_relative_import_files(source))):
                    shutil.copyfile(file, staging / file.name)
