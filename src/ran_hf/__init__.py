"""ran_hf: the Recurrent Attention Network (RAN) as a Hugging Face Transformers model family.

Importing the package registers `RANConfig` and every RAN model with the Auto classes, and marks them for remote
code, so that `save_pretrained` writes a folder (or Hub repo) that loads with `trust_remote_code=True` anywhere. It
also registers the `"extractive-question-answering"` pipeline (`ran_hf.integrations.question_answering`).

Importing it costs little more than importing Transformers: only the configuration is imported at once. The models
(and with them `transformers.modeling_utils`), the pipeline, the ONNX export, the PEFT and sentence-transformers
glue and the checkpoint converter are imported when first used; every public name below is there all along
(`ran_hf.RANForMaskedLM`, `ran_hf.export_onnx`, ...). tests/test_import_cost.py checks which modules it imports.
"""

import copyreg
import importlib
import importlib.abc
import sys

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_ran import RANConfig
from .files.saved_code import QUESTION_ANSWERING_TASK


__version__ = "0.1.0"

# The model each Auto class loads for a RAN config, and the module that defines it.
AUTO_CLASSES = {
    AutoModel: "RANModel",
    AutoModelForCausalLM: "RANForCausalLM",
    AutoModelForMaskedLM: "RANForMaskedLM",
    AutoModelForQuestionAnswering: "RANForQuestionAnswering",
    AutoModelForSeq2SeqLM: "RANForPrefixLM",  # decoder-only: source and target in one text (docs/seq2seq.md)
    AutoModelForSequenceClassification: "RANForSequenceClassification",
    AutoModelForTokenClassification: "RANForTokenClassification",
}
MODEL_MODULES = ("modeling_ran", "prefix_lm")

# Every public name that is not the configuration, and the module it is imported from on first use.
_LAZY_NAMES = {
    "RANCache": "cache_ran",
    "RANModel": "modeling_ran",
    "RANPreTrainedModel": "modeling_ran",
    "RANForCausalLM": "modeling_ran",
    "RANForMaskedLM": "modeling_ran",
    "RANForQuestionAnswering": "modeling_ran",
    "RANForSequenceClassification": "modeling_ran",
    "RANForTokenClassification": "modeling_ran",
    "RANForPrefixLM": "prefix_lm",
    "prefix_lm_features": "integrations.seq2seq_features",
    "ExtractiveQuestionAnsweringPipeline": "integrations.question_answering",
    "export_onnx": "integrations.onnx_export",
    "RAN_LORA_TARGET_MODULES": "integrations.lora",
    "RAN_NEW_HEAD_MODULES": "integrations.lora",
    "frozen_new_weights": "integrations.lora",
    "ran_lora_config": "integrations.lora",
    "convert_rannet_checkpoint": "integrations.convert_rannet",
}


def __getattr__(name: str):
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY_NAMES))


def _register_models(module) -> None:
    """Put a model module's classes in the Auto classes, in place of their stand-ins. (Not `register_for_auto_class`:
    the config's `save_pretrained` ships the code, flat, as files/saved_code.py says.)"""
    for auto_class, name in AUTO_CLASSES.items():
        model_class = module.__dict__.get(name)
        if model_class is not None:
            auto_class.register(RANConfig, model_class, exist_ok=True)


def _register_pipeline(_module=None) -> None:
    """Register the pipeline once both `transformers.pipelines` and its module are imported (either may import the
    other: the pipeline's module imports `transformers.Pipeline`)."""
    pipelines = sys.modules.get("transformers.pipelines")
    if pipelines is None or QUESTION_ANSWERING_TASK in _registered_tasks:
        return
    answering = sys.modules.get(f"{__name__}.integrations.question_answering")
    if answering is None:
        importlib.import_module(f"{__name__}.integrations.question_answering")  # registers once imported
        return
    if not hasattr(answering, "ExtractiveQuestionAnsweringPipeline"):
        return  # being imported (it imported the pipelines): registers once imported
    # Transformers 5 removed its `question-answering` pipeline; this one reads the whole document in one pass.
    pipelines.PIPELINE_REGISTRY.register_pipeline(
        QUESTION_ANSWERING_TASK,
        pipeline_class=answering.ExtractiveQuestionAnsweringPipeline,
        pt_model=AutoModelForQuestionAnswering,
        type="text",
    )
    _registered_tasks.add(QUESTION_ANSWERING_TASK)


_registered_tasks: set = set()


class _LazyModelClass(type):
    """The type of the stand-ins registered with the Auto classes until the models are imported: a stand-in has its
    model's name and module, and anything else asked of it (`from_pretrained`, `_from_config`, a call, `isinstance`)
    imports the model (which replaces the stand-in in the Auto classes) and goes to it."""

    def _load_model(cls):
        module = importlib.import_module(cls.__module__)
        _after_import.fire_now(module.__name__, module)
        return getattr(module, cls.__name__)

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(cls._load_model(), name)

    def __call__(cls, *args, **kwargs):
        return cls._load_model()(*args, **kwargs)

    def __instancecheck__(cls, instance):
        return isinstance(instance, cls._load_model())

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, cls._load_model())

    def __repr__(cls):
        return f"<stand-in for class '{cls.__module__}.{cls.__name__}'>"


def _model_class(module: str, name: str) -> type:
    """The model class a stand-in stands for: what unpickling a pickled stand-in gives."""
    return getattr(importlib.import_module(module), name)


# Pickled (by a DataLoader's workers, a multiprocessing pool, `copy`), a stand-in is the model class it stands for:
# pickle would otherwise find the real class under the stand-in's name and refuse ("not the same object").
copyreg.pickle(_LazyModelClass, lambda stand_in: (_model_class, (stand_in.__module__, stand_in.__name__)))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback once a module named here has been imported, whoever imports it, then forgets the name (and
    leaves `sys.meta_path` when it has none left). It finds no module itself: it asks the finders after it for the
    module's spec and wraps that spec's loader's `exec_module`."""

    def __init__(self, callbacks: dict):
        self.callbacks = callbacks

    def find_spec(self, name, path=None, target=None):
        if name not in self.callbacks:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            exec_module = loader.exec_module

            def exec_then_call(module):
                exec_module(module)
                self.fire_now(name, module)

            loader.exec_module = exec_then_call
        return spec

    def fire_now(self, name, module) -> None:
        callback = self.callbacks.pop(name, None)
        if not self.callbacks and self in sys.meta_path:
            sys.meta_path.remove(self)
        if callback is not None:
            callback(module)

    def watch(self) -> None:
        """Wait in `sys.meta_path` for the modules; fire at once for those already imported."""
        sys.meta_path.insert(0, self)
        for name in [name for name in self.callbacks if name in sys.modules]:
            self.fire_now(name, sys.modules[name])


AutoConfig.register(RANConfig.model_type, RANConfig, exist_ok=True)
# The Auto classes get stand-ins now and the models when they are imported (by anyone): `import ran_hf` does not
# import `transformers.modeling_utils`, which costs as much as Transformers itself.
for _auto_class, _name in AUTO_CLASSES.items():
    _namespace = {"__module__": f"{__name__}.{_LAZY_NAMES[_name]}", "config_class": RANConfig}
    _auto_class.register(RANConfig, _LazyModelClass(_name, (), _namespace), exist_ok=True)
# The pipeline's task is registered once `transformers.pipelines` is imported (by `from transformers import
# pipeline`, say), not by this import: importing the pipelines costs about as much as Transformers does. Pipeline
# classes subclass `transformers.Pipeline`, so the registration cannot happen before. A loaded config leaves out the
# `custom_pipelines` entry of this task (saved_code.py): the registered pipeline serves it in this process.
RANConfig.tasks_registered_here = frozenset({QUESTION_ANSWERING_TASK})
_after_import = _AfterImport(
    {
        "transformers.pipelines": _register_pipeline,
        f"{__name__}.integrations.question_answering": _register_pipeline,
        **{f"{__name__}.{module}": _register_models for module in MODEL_MODULES},
    }
)
_after_import.watch()
del _auto_class, _name, _namespace

__all__ = [
    "RAN_LORA_TARGET_MODULES",
    "RAN_NEW_HEAD_MODULES",
    "ExtractiveQuestionAnsweringPipeline",
    "RANCache",
    "RANConfig",
    "RANForCausalLM",
    "RANForMaskedLM",
    "RANForPrefixLM",
    "RANForQuestionAnswering",
    "RANForSequenceClassification",
    "RANForTokenClassification",
    "RANModel",
    "RANPreTrainedModel",
    "convert_rannet_checkpoint",
    "export_onnx",
    "frozen_new_weights",
    "prefix_lm_features",
    "ran_lora_config",
]
