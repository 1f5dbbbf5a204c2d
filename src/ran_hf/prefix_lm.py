"""Sequence-to-sequence RAN as a prefix LM: `rannet`'s `RanNetForSeq2Seq` (UniLM's mask) with Transformers' API.

One text holds the source, then the target; `token_type_ids` mark them (0 source, 1 target). In every window source
tokens read each other both ways and target tokens read the source and the targets before them; the cell sits in
the source, so cells, and the memory review that reads them, carry the source only. Training scores the target,
each token from the ones before it (the labels are shifted, as Transformers' causal LMs shift theirs); `generate()`
continues a source with its target. docs/seq2seq.md explains the choice and where it departs from `rannet`.
"""

import copy

import torch
import torch.nn.functional as F
from transformers import GenerationMixin
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_utils import slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, logging
from transformers.utils.generic import can_return_tuple

from .configuration_ran import RANConfig
from .input_checks import input_batch_shape
from .label_checks import scored_token_loss
from .modeling_ran import (
    HEAD_ARGS,
    RANLanguageModelBase,
    check_language_model_labels,
    head_documents,
    head_output,
    head_outputs,
)
from .outputs_ran import RANCausalLMOutputWithPast


logger = logging.get_logger(__name__)

SOURCE, TARGET = 0, 1


def target_labels(labels: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """The labels a prefix LM scores, already shifted: position t predicts token t + 1 when that token is a real
    target token (a source token is read both ways, so predicting one would be copying it)."""
    scored = token_type_ids == TARGET
    if attention_mask is not None:
        scored = scored & attention_mask.bool().to(scored.device)
    labels = labels.masked_fill(~scored.to(labels.device), -100)
    return F.pad(labels[:, 1:], (0, 1), value=-100)


@auto_docstring(
    custom_intro="""
    Sequence-to-sequence RAN as a prefix LM (`rannet`'s `RanNetForSeq2Seq`): the official LM head over a text whose
    `token_type_ids` mark its source (0) and target (1). `generate()` continues a source with its target, reading
    the whole text again at every step (no cache: a target token's state depends on nothing after it).
    """
)
class RANForPrefixLM(RANLanguageModelBase, GenerationMixin):
    reads_token_types = True  # its source (0) and target (1)
    # What `ran_hf.export_onnx` (and `torch.export`) answer at once: tracing it fails after minutes on `aten.cummax`.
    onnx_export_refusal = (
        "RANForPrefixLM cannot be exported to ONNX: its graph would need `token_type_ids` as an input, and the prefix "
        "mask they build is not exportable. Export the encoder the prefix LM was trained from (`RANForMaskedLM`, "
        "`RANModel`), or generate with the PyTorch model."
    )

    def __init__(self, config: RANConfig):
        handed = config
        if config.is_causal:  # a copy, whose fields left to the design take the encoder's
            config = copy.deepcopy(config)
            config.is_causal = False
        causal_only = [
            f"`{name}={getattr(config, name)!r}`"
            for name, unset in (("cutoffs", None), ("associative_memory", False))
            if getattr(config, name, unset) != unset
        ]
        if causal_only:  # checked before the config's rules, whose error would ask for is_causal=True
            raise ValueError(
                f"RANForPrefixLM reads its source both ways (`is_causal=False`), and {' and '.join(causal_only)} "
                f"{'belong' if len(causal_only) > 1 else 'belongs'} to the causal LM (RANForCausalLM) only. Build the "
                "prefix LM from a config without it."
            )
        if config is not handed:
            logger.warning(
                "RANForPrefixLM reads its source both ways: it runs on a copy of the config with `is_causal=False` "
                "(the config handed to it is unchanged; fields left to the layer design take the encoder's)."
            )
            config.validate()
        super().__init__(config)

    @can_return_tuple
    @auto_docstring(custom_args=HEAD_ARGS)
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANCausalLMOutputWithPast:
        r"""
        token_type_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            0 for the source, 1 for the target after it (padding: any value). None: the whole input is source.
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Usually `input_ids`: the loss predicts every target token from the tokens before it (position t predicts
            token t + 1, as in causal LMs); labels of source tokens, -100 and padding are ignored.
        logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0):
            Compute logits only for the last `logits_to_keep` positions (0: all), or for the given positions.
        """
        if torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export():
            raise NotImplementedError(self.onnx_export_refusal)
        batch_shape = input_batch_shape(input_ids, inputs_embeds, self.config.hidden_size)
        device = (input_ids if input_ids is not None else inputs_embeds).device
        if labels is not None and token_type_ids is None:
            raise ValueError(
                "`labels` score the target tokens, which `token_type_ids` mark (0 source, 1 target); without them the "
                "whole input is source and nothing would be scored (a loss of 0). Pass the `token_type_ids` of each "
                "(source, target) text, as `ran_hf.prefix_lm_features` makes them."
            )
        if token_type_ids is None:
            token_type_ids = torch.full(batch_shape, SOURCE, dtype=torch.long, device=device)
        check_language_model_labels(self, labels, logits_to_keep, input_ids, inputs_embeds, "every target position")
        if labels is not None and not torch.compiler.is_compiling() and not bool((token_type_ids == TARGET).any()):
            raise ValueError(
                "`labels` score the target tokens, but `token_type_ids` mark every token as source (0): nothing "
                "would be scored (a loss of 0). Mark each text's target with 1, as `ran_hf.prefix_lm_features` does."
            )
        documents = head_documents(self, input_ids, inputs_embeds, attention_mask, kwargs)
        outputs = head_outputs(
            self, documents, input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            token_type_ids=token_type_ids, initial_cell=initial_cell, **kwargs,
        )  # fmt: skip
        logits = self.decoder(self.head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)))

        loss = None
        if labels is not None:
            shifted = target_labels(labels, token_type_ids, attention_mask)
            if documents is not None:  # packed rows: no document's first token is predicted from the one before
                shifted = shifted.masked_fill(documents.next_token_starts().to(shifted.device), -100)
            kwargs.pop("shift_labels", None)
            loss = scored_token_loss(
                ForCausalLMLoss, logits, labels, shifted, vocab_size=self.config.vocab_size, shift_labels=shifted,
                **kwargs,
            )  # fmt: skip
        return head_output(RANCausalLMOutputWithPast, outputs, loss=loss, logits=logits)

    # ---- generation: the prompt is the source, every generated token is target ------------------------------------

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # no cache: each step reads the whole text again

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """[`GenerationMixin.generate`] from a source: `input_ids` (or `inputs`) are the source unless
        `token_type_ids` say otherwise (a target already begun); the tokens generated are target.

        Returns the generated tokens only, as every model behind `AutoModelForSeq2SeqLM` does (an encoder-decoder's
        output holds no source). With `return_dict_in_generate=True`, `sequences` holds them."""
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if input_ids is None:  # (`inputs_embeds` alone: gone after the first step, which the next ones read again)
            raise ValueError(
                "RANForPrefixLM continues a source: pass its token ids (`input_ids`); every step reads the whole text "
                "again by its ids, so it generates neither from nothing nor from `inputs_embeds` alone."
            )
        if not torch.is_tensor(input_ids):
            raise ValueError(
                f"The source must be a tensor of token ids, got {type(input_ids).__name__}: pass "
                '`torch.tensor(...)`, or call the tokenizer with `return_tensors="pt"`.'
            )
        if kwargs.get("token_type_ids") is None and torch.is_tensor(input_ids):
            kwargs["token_type_ids"] = torch.full_like(input_ids, SOURCE)
        output = super().generate(inputs, generation_config, **kwargs)
        given = input_ids.shape[1]  # the source, and a target already begun
        if torch.is_tensor(output):
            return output[:, given:]
        output.sequences = output.sequences[:, given:]
        return output

    def prepare_inputs_for_generation(
        self, input_ids, attention_mask=None, token_type_ids=None, inputs_embeds=None, **kwargs
    ):  # fmt: skip
        if inputs_embeds is not None:
            raise ValueError("RANForPrefixLM generates from `input_ids`: it reads the whole text again every step.")
        model_inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "token_type_ids": token_type_ids,
            "logits_to_keep": 1,
        }
        # All else `generate` passes on (`initial_cell`, ...) goes to the forward, as Transformers' own method does.
        for name, value in kwargs.items():
            if value is not None and name not in self._NOT_STEP_INPUTS:
                model_inputs[name] = value
        return model_inputs

    # What a step without a cache, reading the whole text again, does not take: a cache, the generation loop's own
    # bookkeeping, positions (a window's, made by the model; given ones would mark packed documents), and labels.
    _NOT_STEP_INPUTS = ("use_cache", "past_key_values", "next_sequence_length", "is_first_iteration", "position_ids",
                        "labels")  # fmt: skip

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
        token_type_ids = model_kwargs.pop("token_type_ids", None)
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_new_tokens
        )
        if token_type_ids is not None:  # generated tokens are target (Transformers would repeat the last type)
            model_kwargs["token_type_ids"] = F.pad(token_type_ids, (0, num_new_tokens), value=TARGET)
        return model_kwargs


__all__ = ["RANForPrefixLM", "target_labels"]
