"""PyTorch Recurrent Attention Network (RAN), Li et al., ACL 2023: the task heads on `RANModel` (ran_model.py).

The layer is in ran_layer.py, the window layout in window_layout.py. A saved model ships this file with the sibling
modules it imports, so that `trust_remote_code=True` loads every head below without `ran_hf` installed. The prefix LM
is in prefix_lm.py.
"""

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, logging
from transformers.utils.generic import can_return_tuple

from .adaptive_softmax import RANAdaptiveSoftmax, RANOutputMapping, adaptive_lm_loss
from .building_blocks import RANCenteredRMSNorm, activation_function, apply_dropout
from .cache_ran import RANCache
from .configuration_ran import RANConfig
from .generation_ran import RANGenerationMixin
from .input_checks import input_batch_shape
from .label_checks import (
    check_answer_positions,
    check_sequence_labels,
    check_token_labels,
    ignore_padding,
    scored_token_loss,
    sequence_loss,
)
from .outputs_ran import (
    RANCausalLMOutputWithPast,
    RANMaskedLMOutput,
    RANQuestionAnsweringModelOutput,
    RANSequenceClassifierOutput,
    RANTokenClassifierOutput,
)
from .packed_documents import PackedDocuments, boundary_signals, packed_documents_of
from .pretrained_ran import RANPreTrainedModel, cache_transaction
from .ran_model import RANModel


logger = logging.get_logger(__name__)

# The arguments every head takes besides Transformers' own (`auto_docstring` documents those).
HEAD_ARGS = r"""
    initial_cell (`torch.FloatTensor` of shape `(batch_size, hidden_size)`, *optional*):
        The cell the first layer starts from instead of its learned one (`rannet`'s `with_cell=True`), e.g. an
        earlier call's `last_cell`; see [`RANModel.forward`].
"""


def check_head_config(head: RANPreTrainedModel) -> None:
    """A head's config edits, refused with the fix or taken up (`RANPreTrainedModel.check_config`), before its labels
    are read or its base model runs: the head's own modules (its classifier's size, its dropout) included. Nothing to
    do when the config was not edited; compiled code skips it."""
    if not torch.compiler.is_compiling():
        head.check_config()


def head_documents(
    head: RANPreTrainedModel, input_ids, inputs_embeds, attention_mask, kwargs
) -> PackedDocuments | None:
    """The documents of packed rows (packed_documents.py), for a head whose labels or loss follow them: found once,
    then handed to the base model (`head_outputs`). None, reading nothing, when no boundary marker is given."""
    if not boundary_signals(kwargs):
        return None
    inputs = {"input_ids": input_ids, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask}
    return packed_documents_of(head.model, {**kwargs, **inputs})


def head_outputs(head: RANPreTrainedModel, documents: PackedDocuments | None = None, **inputs):
    """The prelude every head shares: its base model's outputs as a `RANModelOutput` (the head reads fields by name,
    whatever `return_dict` the caller or the config asks for). A head checks its config (`check_head_config`), then
    its labels, before it calls this.

    `token_type_ids` mark a prefix LM's source and target: the classifier, token-classifier and QA heads leave them
    out, so that a BERT-style tokenizer's pair ids (`model(**tokenizer(a, b))`, Transformers' pipelines) change
    nothing; the language models read them (`reads_token_types`), and a causal model refuses them
    (`check_token_type_ids`)."""
    if inputs.get("token_type_ids") is not None and not head.reads_token_types and not head.config.is_causal:
        logger.warning_once(
            f"{type(head).__name__} ignores `token_type_ids`: RAN has no segment embeddings, and its token types mark "
            "a prefix LM's source and target (RANForPrefixLM). Call the tokenizer with `return_token_type_ids=False` "
            "to pass none."
        )
        inputs["token_type_ids"] = None
    if documents is not None:
        inputs["packed_documents"] = documents  # found by the head: the base model regroups by them
    return head.model(**inputs, return_dict=True)


def check_head_token_labels(head: RANPreTrainedModel, labels, input_ids, inputs_embeds, num_classes: int, name: str):
    """A token head's labels (one `name` of `num_classes` per token, -100 ignored): their shape and dtype, then their
    range in one host read, before the head runs its base model. Nothing to check without labels."""
    check_head_config(head)  # an edited label count or vocabulary is named before the labels are read against it
    if labels is not None:
        batch_shape = input_batch_shape(input_ids, inputs_embeds, head.config.hidden_size)
        check_token_labels(labels, batch_shape, num_classes, name).read_and_judge()


def check_language_model_labels(
    head: RANPreTrainedModel, labels, logits_to_keep, input_ids, inputs_embeds, scored: str = "every position"
):
    """A language model's labels: scored at `scored`, so all logits are kept; then `check_head_token_labels`."""
    if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError(
            f"`labels` are scored at {scored}, but `logits_to_keep` keeps only some logits: pass "
            "`logits_to_keep=0` (the default) with `labels`."
        )
    vocab_size = None if labels is None else head.config.vocab_size  # (a config read runs three Python calls)
    check_head_token_labels(head, labels, input_ids, inputs_embeds, vocab_size, "token id")


def head_output(output_class, outputs, **fields):
    """A head's `output_class` from its own `fields` and the base model's recorded outputs."""
    return output_class(
        **fields,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        memory_attentions=outputs.memory_attentions,
    )


class RANPredictionHead(nn.Module):
    """MLM transform of the official model: dropout -> swish(Dense) -> LayerNorm."""

    def __init__(self, config: RANConfig):
        super().__init__()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = activation_function(config.hidden_act)
        self.norm = RANCenteredRMSNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(apply_dropout(self.dropout, hidden_states))))


class RANLanguageModelBase(RANPreTrainedModel):
    """What both language models share: the encoder and the official LM head, tied to the token embedding when the
    config says so (`tie_word_embeddings`: the encoder's default, not the causal model's)."""

    _tied_weights_keys = {"decoder.weight": "model.embeddings.word_embeddings.weight"}

    def __init__(self, config: RANConfig):
        super().__init__(config)
        self.model = RANModel(config, add_pooling_layer=False)
        self.uses_adaptive_softmax = (
            config.cutoffs is not None
        )  # (`cutoffs` is an architecture field: fixed once built)
        if self.uses_adaptive_softmax:
            # The official adaptive LM: dropout, a swish output mapping, and the adaptive softmax, which reads the
            # adaptive embedding's clusters itself (always shared, whatever `tie_word_embeddings` says).
            self._tied_weights_keys = {}
            self.head = RANOutputMapping(config.hidden_size, config.hidden_dropout_prob)
            self.decoder = RANAdaptiveSoftmax(config.vocab_size, config.hidden_size, config.cutoffs, config.div_val)
        else:
            self.head = RANPredictionHead(config)
            self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        super()._init_weights(module)
        if module is self and getattr(self.decoder, "bias", None) is not None:
            init.zeros_(self.decoder.bias)

    def get_output_embeddings(self):
        return None if self.uses_adaptive_softmax else self.decoder  # an adaptive softmax has no one matrix

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        if self.config.cutoffs is not None:
            raise NotImplementedError(
                f"An adaptive vocabulary (`cutoffs={self.config.cutoffs}`) cannot be resized by "
                "`resize_token_embeddings`: its ids are cut into clusters at fixed ids, each with its own embedding, "
                "projection and softmax bias. Build a model from a config with the new `vocab_size` (and `cutoffs` "
                "below it) and train it, or use `cutoffs=None` (one embedding, which resizes)."
            )
        return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)

    def set_output_embeddings(self, new_embeddings: nn.Linear):
        self.decoder = new_embeddings


@auto_docstring(custom_intro="RAN with the official masked-language-modelling head, tied to the token embedding.")
class RANForMaskedLM(RANLanguageModelBase):
    reads_token_types = True  # the official seq2seq model is this network with the prefix mask (docs/seq2seq.md)

    def __init__(self, config: RANConfig):
        if config.is_causal:  # `AutoModelForMaskedLM` on a causal model's folder, say
            raise ValueError(
                "RANForMaskedLM fills a mask from the words on both sides, but this config is causal "
                "(`is_causal=True`): every token would read only the words before it. Load a causal model's folder "
                "with `AutoModelForCausalLM`; to read it both ways (which it was not trained to), pass "
                "`is_causal=False` to `from_pretrained`."
            )
        super().__init__(config)

    @can_return_tuple
    @auto_docstring(custom_args=HEAD_ARGS)
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANMaskedLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Token ids to predict at masked positions; -100 (and every padding position) is ignored.
        """
        check_head_token_labels(self, labels, input_ids, inputs_embeds, self.config.vocab_size, "token id")
        outputs = head_outputs(
            self, input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            initial_cell=initial_cell, **kwargs,
        )  # fmt: skip
        logits = self.decoder(self.head(outputs.last_hidden_state))

        loss = None
        if labels is not None:
            labels = ignore_padding(labels, attention_mask)
            loss = scored_token_loss(
                self.loss_function, logits, labels, labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return head_output(RANMaskedLMOutput, outputs, loss=loss, logits=logits)


@auto_docstring(
    custom_intro="RAN with a linear classifier (or regressor) on the document representation, `pooler_output`."
)
class RANForSequenceClassification(RANPreTrainedModel):
    def __init__(self, config: RANConfig):
        config.validate()  # its labels may have been set on the config after it was made
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = RANModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    @auto_docstring(custom_args=HEAD_ARGS)
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.Tensor | None = None,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANSequenceClassifierOutput:
        r"""
        labels (`torch.Tensor`, *optional*):
            `(batch_size,)` class ids for single-label classification, `(batch_size, num_labels)` 0/1 targets for
            multi-label classification, or float targets for regression (`num_labels == 1`); the problem type follows
            `config.problem_type` and is inferred as in Transformers when unset.
        """
        check_head_config(self)  # an edited label count is named before the labels are read against it
        # Packed rows (`position_ids` that restart, `cu_seq_lens_*`): one document a row of logits and of labels.
        documents = head_documents(self, input_ids, inputs_embeds, attention_mask, kwargs)
        problem_type, rows_mask = None, attention_mask if documents is None else documents.attention_mask
        if labels is not None:
            batch_size = input_batch_shape(input_ids, inputs_embeds, self.config.hidden_size)[0]
            if documents is not None:
                batch_size = documents.num_documents
            labels, problem_type, label_checks = check_sequence_labels(labels, batch_size, self.config)
            label_checks.read_and_judge()  # one host read, before any work of the base model
        outputs = head_outputs(
            self, documents, input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            initial_cell=initial_cell, **kwargs,
        )  # fmt: skip
        logits = self.classifier(apply_dropout(self.dropout, outputs.pooler_output))

        loss = None
        if labels is not None:
            loss = sequence_loss(self.loss_function, logits, labels, problem_type, rows_mask, self.config, **kwargs)
        return head_output(RANSequenceClassifierOutput, outputs, loss=loss, logits=logits)


@auto_docstring(custom_intro="RAN with a linear classifier on every token state (e.g. named-entity recognition).")
class RANForTokenClassification(RANPreTrainedModel):
    def __init__(self, config: RANConfig):
        config.validate()  # its labels may have been set on the config after it was made
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = RANModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    @auto_docstring(custom_args=HEAD_ARGS)
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANTokenClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Class id of every token; -100 (and every padding position) is ignored.
        """
        check_head_token_labels(self, labels, input_ids, inputs_embeds, self.num_labels, "class id")
        outputs = head_outputs(
            self, input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            initial_cell=initial_cell, **kwargs,
        )  # fmt: skip
        logits = self.classifier(apply_dropout(self.dropout, outputs.last_hidden_state))

        loss = None
        if labels is not None:
            labels = ignore_padding(labels, attention_mask)
            loss = scored_token_loss(self.loss_function, logits, labels, labels, config=self.config, **kwargs)
        return head_output(RANTokenClassifierOutput, outputs, loss=loss, logits=logits)


@auto_docstring(
    custom_intro="""
    Causal language model: a strictly causal, recurrent RAN with the official LM head (its decoder is untied from
    the embedding unless the config says `tie_word_embeddings=True`).
    Generation carries a `RANCache`: constant-size state per layer plus a key and a value per finished window.
    """
)
class RANForCausalLM(RANLanguageModelBase, RANGenerationMixin):
    # A recurrent state cannot be rolled back to an earlier token: assisted generation is refused up front.
    _is_stateful = True

    def __init__(self, config: RANConfig):
        if not config.is_causal:
            logger.warning(
                "RANForCausalLM is a causal model: it runs on a copy of the config with `is_causal=True` (the config "
                "handed to it is unchanged; fields left to the layer design take the causal one's, the others stay "
                f"as they are, `tie_word_embeddings={config.tie_word_embeddings}` included)."
            )
            config = config.with_causal(True)
        super().__init__(config)

    @cache_transaction  # a forward that fails, in the layers or in the loss, leaves `past_key_values` as it was
    @can_return_tuple
    @auto_docstring(custom_args=HEAD_ARGS)
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        past_key_values: RANCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANCausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Usually `input_ids`: the loss predicts token t + 1 from tokens up to t; -100 and padding are ignored.
        logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0):
            Compute logits only for the last `logits_to_keep` positions (0: all), or for the given positions.
        """
        check_language_model_labels(self, labels, logits_to_keep, input_ids, inputs_embeds)
        documents = head_documents(self, input_ids, inputs_embeds, attention_mask, kwargs)
        outputs = head_outputs(
            self, documents, input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            initial_cell=initial_cell, past_key_values=past_key_values, use_cache=use_cache, **kwargs,
        )  # fmt: skip
        if documents is not None and labels is not None:
            # A packed row's document is not predicted from the one before it: its first token is never scored, as
            # a text's first token is not (`DataCollatorWithFlattening` marks it so in its labels already).
            labels = labels.masked_fill(documents.starts.to(labels.device), -100)
            if kwargs.get("shift_labels") is not None:
                ends = documents.next_token_starts().to(kwargs["shift_labels"].device)
                kwargs["shift_labels"] = kwargs["shift_labels"].masked_fill(ends, -100)
        hidden_states = outputs.last_hidden_state
        if not self.uses_adaptive_softmax:
            logits = self.decoder(self.head(slice_logits_to_keep(hidden_states, logits_to_keep)))
        elif labels is None:  # float32 log-probabilities of every id
            kept = slice_logits_to_keep(hidden_states, logits_to_keep)
            logits = self.decoder(self.head(kept), self.model.embeddings.word_embeddings)
        else:
            logits = None  # the adaptive softmax scores each label without building the whole distribution

        loss = None
        if labels is not None and self.uses_adaptive_softmax:
            loss = adaptive_lm_loss(
                self.decoder,
                self.model.embeddings.word_embeddings,
                self.head(hidden_states),
                ignore_padding(labels, attention_mask),
                **kwargs,
            )
        elif labels is not None:
            labels = ignore_padding(labels, attention_mask)
            # Position t predicts token t + 1, so the first label is never scored.
            scored = kwargs["shift_labels"] if kwargs.get("shift_labels") is not None else labels[:, 1:]
            loss = scored_token_loss(
                self.loss_function, logits, labels, scored, vocab_size=self.config.vocab_size, **kwargs
            )
        return head_output(
            RANCausalLMOutputWithPast, outputs, loss=loss, logits=logits, past_key_values=outputs.past_key_values
        )


@auto_docstring(
    custom_intro="""
    RAN with a span head for extractive question answering: a linear layer on every token state gives the start and
    end logits of the answer over the whole input (question and document as one pair) in a single pass, however long
    the document.
    """
)
class RANForQuestionAnswering(RANPreTrainedModel):
    def __init__(self, config: RANConfig):
        super().__init__(config)
        self.model = RANModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)  # start and end logit of every token
        self.post_init()

    @can_return_tuple
    @auto_docstring(custom_args=HEAD_ARGS)
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        initial_cell: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RANQuestionAnsweringModelOutput:
        r"""
        start_positions (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Index of the answer's first token. As in Transformers, a position at or past the end of the input
            (`sequence_length`) leaves the answer out of the loss; so does one on padding. A negative position, an
            answer left out at one end only, or one that starts after it ends is refused. A batch whose answers are
            all left out has a loss of 0.
        end_positions (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Index of the answer's last token.
        """
        check_head_config(self)
        if (start_positions is None) != (end_positions is None):
            raise ValueError("Give both `start_positions` and `end_positions` for a loss, or neither.")
        # Packed rows: logits per token as packed; answer positions, one per document, counted from its first token.
        documents = head_documents(self, input_ids, inputs_embeds, attention_mask, kwargs)
        if start_positions is not None:
            batch_shape = input_batch_shape(input_ids, inputs_embeds, self.config.hidden_size)
            answer_mask = attention_mask
            if documents is not None:
                batch_shape = (documents.num_documents, documents.longest)
                answer_mask = documents.attention_mask
            start_positions, end_positions, answered, answer_checks = check_answer_positions(
                start_positions, end_positions, answer_mask, batch_shape
            )
            answer_checks.read_and_judge()  # one host read, before any work of the base model
        outputs = head_outputs(
            self, documents, input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            initial_cell=initial_cell, **kwargs,
        )  # fmt: skip
        logits = self.qa_outputs(apply_dropout(self.dropout, outputs.last_hidden_state))
        if attention_mask is not None:
            # Padding is never an answer: without it in the softmax over positions, the loss and the span
            # probabilities do not depend on how a sequence is padded.
            padding = ~attention_mask.bool()[:, -logits.shape[1] :, None].to(logits.device)
            logits = logits.masked_fill(padding, torch.finfo(logits.dtype).min)
        start_logits, end_logits = (side.squeeze(-1).contiguous() for side in logits.split(1, dim=-1))

        loss = None
        if start_positions is not None:
            if kwargs.get("num_items_in_batch") is None:
                # Summed over the answers, divided by their number: their mean, and 0 (not NaN) when none is scored.
                kwargs["num_items_in_batch"] = answered
            start_positions, end_positions = start_positions.to(logits.device), end_positions.to(logits.device)
            scored_start, scored_end = start_logits, end_logits
            if documents is not None:  # the softmax over positions runs over each document's own tokens
                padding = ~documents.attention_mask.to(logits.device)
                scored_start, scored_end = (
                    documents.to_documents(side).masked_fill(padding, torch.finfo(side.dtype).min)
                    for side in (start_logits, end_logits)
                )
            loss = self.loss_function(scored_start, scored_end, start_positions, end_positions, **kwargs)
        return head_output(
            RANQuestionAnsweringModelOutput, outputs, loss=loss, start_logits=start_logits, end_logits=end_logits
        )


__all__ = [
    "RANForCausalLM",
    "RANForMaskedLM",
    "RANForQuestionAnswering",
    "RANForSequenceClassification",
    "RANForTokenClassification",
    "RANModel",
    "RANPreTrainedModel",
]
