"""LoRA for RAN with PEFT: which layers to adapt, and which head modules to train in full.

PEFT has no default target modules for `model_type="ran"`, so a `LoraConfig` for RAN must name them:
`RAN_LORA_TARGET_MODULES` are the attention projections of every layer, the usual LoRA choice (Hu et al. adapt the
attention weights; adding every linear layer, PEFT's `"all-linear"`, also works here and costs about twice as many
adapter weights):

- `qkv_proj`: the fused query/key/value projection of window attention, which the cell scan uses too (a window's
  cell is projected with the same weights as its tokens);
- `o_proj`: the output projections of window attention and of memory review (`memory_review.o_proj`);
- `q_proj`, `kv_proj`: memory review's query projection and its key/value projection of the cells.

Left out: the gated linear units (`attention_glu`, `cell_scan.cell_glu`, `memory_review.glu`: RAN's gated residuals,
not attention), the pooler, the masked-LM transform and the decoder (the token embedding itself, where tied).

A classifier fine-tuned from an encoder gets new, randomly initialised modules: the pooler (the cell transform) and
the classifier of `RANForSequenceClassification`, the classifier of `RANForTokenClassification`, the span layer of
`RANForQuestionAnswering` (`qa_outputs`). Under LoRA every weight outside the adapters is frozen, so these must be
listed in `modules_to_save` to be trained (and saved with the adapter); `ran_lora_config` does so, and
`frozen_new_weights` finds the new weights a configuration leaves frozen.
The language models' heads are pretrained and stay frozen.

PEFT is optional: it is imported only when a function here needs it.
"""

from collections.abc import Iterable

from torch import nn


RAN_LORA_TARGET_MODULES = ("qkv_proj", "o_proj", "q_proj", "kv_proj")
"""Names of the `nn.Linear` modules a RAN LoRA adapts: window attention (`qkv_proj`, `o_proj`) and memory review
(`q_proj`, `kv_proj`, `o_proj`) in every layer. Matched by name suffix, as PEFT's `target_modules` are."""

RAN_NEW_HEAD_MODULES = {
    "RANForSequenceClassification": ("pooler", "classifier"),
    "RANForTokenClassification": ("classifier",),
    "RANForQuestionAnswering": ("qa_outputs",),
    "RANForMaskedLM": (),
    "RANForCausalLM": (),
    "RANModel": (),
}
"""Per head class, the modules that a checkpoint of another head (a pretrained encoder) does not have, which start
from random weights: LoRA must train them in full (PEFT's `modules_to_save`)."""

PEFT_TASK_TYPES = {
    "RANForSequenceClassification": "SEQ_CLS",
    "RANForTokenClassification": "TOKEN_CLS",
    "RANForQuestionAnswering": "QUESTION_ANS",
    "RANForCausalLM": "CAUSAL_LM",
}
"""PEFT's task type per head (the PeftModel subclass it builds); the masked LM and the bare model have none."""


def ran_head_name(model: nn.Module | type) -> str:
    """The RAN class a model (or model class) is, or derives from: `RANForSequenceClassification`, ..."""
    model_class = model if isinstance(model, type) else type(model)
    for base in model_class.__mro__:
        if base.__name__ in RAN_NEW_HEAD_MODULES:
            return base.__name__
    raise ValueError(f"{model_class.__name__} is not a RAN model (one of {sorted(RAN_NEW_HEAD_MODULES)}).")


def ran_lora_config(
    model: nn.Module | type,
    r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    target_modules: Iterable[str] | str | None = None,
    modules_to_save: Iterable[str] | None = None,
    **kwargs,
):
    """A `peft.LoraConfig` for a RAN model (or model class): `RAN_LORA_TARGET_MODULES` unless `target_modules` is
    given, PEFT's task type for the head, and `modules_to_save` set to the head's new modules
    (`RAN_NEW_HEAD_MODULES`) plus any given. Other keyword arguments go to `LoraConfig`.

        from peft import get_peft_model
        model = AutoModelForSequenceClassification.from_pretrained("path/to/ran-mlm", num_labels=3)
        model = get_peft_model(model, ran_lora_config(model, r=8))
    """
    from peft import LoraConfig

    head = ran_head_name(model)
    if target_modules is None:
        target_modules = list(RAN_LORA_TARGET_MODULES)
    elif not isinstance(target_modules, str):  # a str is a regular expression or "all-linear"
        target_modules = list(target_modules)
    saved = list(dict.fromkeys([*RAN_NEW_HEAD_MODULES[head], *(modules_to_save or ())]))
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=target_modules,
        modules_to_save=saved or None,
        task_type=PEFT_TASK_TYPES.get(head),
        **kwargs,
    )


def frozen_new_weights(peft_model: nn.Module, missing_keys: Iterable[str]) -> list[str]:
    """The newly initialised weights (`missing_keys` of `from_pretrained(..., output_loading_info=True)`) that a
    PEFT model does not train: they would keep their random values. Empty when every new weight is trained.

    A module in `modules_to_save` is trained as a copy (`<module>.modules_to_save.<adapter>`); its original stays
    frozen, so names are compared with those markers removed.
    """
    trained = set()
    for name, parameter in peft_model.named_parameters():
        if parameter.requires_grad:
            name = name.removeprefix("base_model.model.")
            for marker in (".modules_to_save.", ".original_module."):
                if marker in name:
                    before, after = name.split(marker, 1)
                    name = f"{before}.{after.split('.', 1)[1]}"
            trained.add(name)
    return sorted(key for key in missing_keys if key not in trained)
