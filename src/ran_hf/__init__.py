"""ran_hf: the Recurrent Attention Network (RAN) as a Hugging Face Transformers model family.

Importing the package registers `RANConfig` and every RAN model with the Auto classes, and marks them for remote
code, so that `save_pretrained` writes a folder (or Hub repo) that loads with `trust_remote_code=True` anywhere. It
also registers the `"extractive-question-answering"` pipeline (`ran_hf.question_answering`).
"""

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
from transformers.pipelines import PIPELINE_REGISTRY

from .cache_ran import RANCache
from .configuration_ran import RANConfig
from .export import export_onnx
from .lora import RAN_LORA_TARGET_MODULES, RAN_NEW_HEAD_MODULES, frozen_new_weights, ran_lora_config
from .modeling_ran import (
    RANForCausalLM,
    RANForMaskedLM,
    RANForQuestionAnswering,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
    RANPreTrainedModel,
)
from .prefix_lm import RANForPrefixLM, prefix_lm_features
from .question_answering import ExtractiveQuestionAnsweringPipeline

__version__ = "0.1.0"

AUTO_CLASSES = {
    AutoModel: RANModel,
    AutoModelForCausalLM: RANForCausalLM,
    AutoModelForMaskedLM: RANForMaskedLM,
    AutoModelForQuestionAnswering: RANForQuestionAnswering,
    AutoModelForSeq2SeqLM: RANForPrefixLM,  # decoder-only: source and target in one text (docs/seq2seq.md)
    AutoModelForSequenceClassification: RANForSequenceClassification,
    AutoModelForTokenClassification: RANForTokenClassification,
}

AutoConfig.register(RANConfig.model_type, RANConfig, exist_ok=True)
RANConfig.register_for_auto_class()
for auto_class, model_class in AUTO_CLASSES.items():
    auto_class.register(RANConfig, model_class, exist_ok=True)
    model_class.register_for_auto_class(auto_class.__name__)
# Transformers 5 removed its `question-answering` pipeline; this one reads the whole document in one pass.
PIPELINE_REGISTRY.register_pipeline(
    "extractive-question-answering",
    pipeline_class=ExtractiveQuestionAnsweringPipeline,
    pt_model=AutoModelForQuestionAnswering,
    type="text",
)


def __getattr__(name: str):
    # The checkpoint converter (and its TensorFlow-checkpoint reader) loads only when asked for.
    if name == "convert_rannet_checkpoint":
        from .convert_rannet import convert_rannet_checkpoint

        return convert_rannet_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
