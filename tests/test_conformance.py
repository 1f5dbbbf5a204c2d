"""Transformers' own conformance tests (`ModelTesterMixin`, `ConfigTester`) run against every RAN class.

`RANModelTest` covers the bidirectional model and its masked-LM and classification heads, `RANCausalModelTest` the
causal mode and the causal LM. Subclasses run the whole mixin again with one option each: the adaptive softmax
(`cutoffs`), the associative memory, `token_shift` on the encoder, an `initial_cell` input, and the prefix LM. The
common test modules come from the sdist of the installed Transformers version (see `transformers_sdist.py`).

The generative classes (the causal LM with each of its options, the prefix LM) also run Transformers'
`GenerationTesterMixin`, which the sdist lacks: `--transformers-tests=<checkout>` names a Transformers source checkout
to take it from. Without one, each of their test classes has a single generation test, skipped with that reason. The
generation tests that cannot apply to RAN skip with what it lacks (`GENERATION_SKIPS`, `PREFIX_LM_SKIPS`).

Only the adaptive softmax skips two common tests here, for differences of its own. The tests of features RAN lacks
(sliding windows, RoPE scaling, experts, a weight conversion mapping, a tensor-parallel plan, modules kept in float32)
and those that need what a machine may lack (the `kernels` library, GPUs, DeepSpeed) skip themselves, saying so.
"""

import copy
import inspect
import itertools
import re
import unittest
from unittest import mock

import pytest
import torch
from conftest import slow_tests_run, transformers_checkout
from transformers import GenerationMixin
from transformers.models.auto import modeling_auto
from transformers.testing_utils import torch_device
from transformers_sdist import SdistUnavailable, load_common_tests

from ran_hf import (
    RANCache,
    RANConfig,
    RANForCausalLM,
    RANForMaskedLM,
    RANForPrefixLM,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
)


pytestmark = pytest.mark.slow  # Transformers' whole common test suite

if not slow_tests_run():  # before the sdist is downloaded at collection
    pytest.skip("slow: run with --run-slow or RUN_SLOW=1 (CI does)", allow_module_level=True)
try:
    test_modeling_common, test_configuration_common = load_common_tests(transformers_checkout())
except SdistUnavailable as error:  # no registry here: nothing to run, which is not a failure of RAN
    pytest.skip(f"Transformers' common tests are unavailable: {error}", allow_module_level=True)
ModelTesterMixin = test_modeling_common.ModelTesterMixin
ConfigTester = test_configuration_common.ConfigTester
floats_tensor = test_modeling_common.floats_tensor
ids_tensor = test_modeling_common.ids_tensor
random_attention_mask = test_modeling_common.random_attention_mask
# Transformers' own with --transformers-tests, otherwise a stand-in whose one test skips, saying how to run them.
GenerationTesterMixin = test_modeling_common.GenerationTesterMixin

# Transformers' built-in task tables (model type -> class name) and the RAN class of each.
TASK_TABLES = (
    (modeling_auto.MODEL_MAPPING_NAMES, RANModel),
    (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, RANForCausalLM),
    (modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, RANForMaskedLM),
    (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, RANForSequenceClassification),
    (modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, RANForTokenClassification),
    (modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, RANForPrefixLM),  # AutoModelForSeq2SeqLM
)


class RANModelTester:
    """A tiny RAN (window 4, minimum window 2) and inputs of 13 tokens: three windows, the last one a merged tail
    (4 + 4 + 5), and shorter sequences of one to three windows under the random attention masks. `config_options`
    are further config fields; `with_initial_cell` adds an `initial_cell` to the inputs, and `source_length` the
    `token_type_ids` of a prefix LM (that many source tokens, then the target)."""

    def __init__(
        self,
        parent,
        batch_size=13,
        seq_length=13,
        is_training=True,
        use_input_mask=True,
        use_labels=True,
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=8,
        window_size=4,
        min_window_size=2,
        hidden_act="silu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        initializer_range=0.02,
        num_labels=3,
        pad_token_id=0,
        is_causal=False,
        config_options=None,
        with_initial_cell=False,
        source_length=None,
    ):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_input_mask = use_input_mask
        self.use_labels = use_labels
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.window_size = window_size
        self.min_window_size = min_window_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.initializer_range = initializer_range
        self.num_labels = num_labels
        self.pad_token_id = pad_token_id
        self.is_causal = is_causal
        self.config_options = config_options or {}
        self.with_initial_cell = with_initial_cell
        self.source_length = source_length
        self.use_cache = False  # (see `get_config`)
        # Window attention weights: every token over its window's read cell and slots (a merged tail included).
        min_window = 1 if is_causal or source_length is not None else min_window_size  # a prefix LM never merges
        self.key_length = 1 + window_size + min_window - 1

    def get_config(self) -> RANConfig:
        config = RANConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            window_size=self.window_size,
            min_window_size=self.min_window_size,
            hidden_act=self.hidden_act,
            hidden_dropout_prob=self.hidden_dropout_prob,
            attention_probs_dropout_prob=self.attention_probs_dropout_prob,
            initializer_range=self.initializer_range,
            num_labels=self.num_labels,
            pad_token_id=self.pad_token_id,
            is_causal=self.is_causal,
            **self.config_options,
        )
        if self.is_causal:
            # A causal RAN caches when a call asks (`use_cache=True`, as `generate` does), not by default: RANConfig
            # has no `use_cache` field, whose absence Transformers' generation tests take for a model without a
            # cache. Transformers reads the field as the default of every call: False is RAN's own default.
            config.use_cache = self.use_cache
        return config

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = random_attention_mask([self.batch_size, self.seq_length]) if self.use_input_mask else None
        sequence_labels = token_labels = None
        if self.use_labels:
            sequence_labels = ids_tensor([self.batch_size], self.num_labels)
            token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
        return self.get_config(), input_ids, input_mask, sequence_labels, token_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, input_mask, _, _ = self.prepare_config_and_inputs()
        inputs = {"input_ids": input_ids, "attention_mask": input_mask}
        if self.with_initial_cell:  # e.g. the `last_cell` of the text before
            inputs["initial_cell"] = floats_tensor([self.batch_size, self.hidden_size])
        if self.source_length is not None:
            inputs["token_type_ids"] = (
                (torch.arange(self.seq_length) >= self.source_length).long().expand_as(input_ids)
            )
        return config, inputs

    def create_and_check_model(self, config, input_ids, input_mask, sequence_labels, token_labels):
        model = RANModel(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))
        self.parent.assertEqual(result.pooler_output.shape, (self.batch_size, self.hidden_size))

        result = model(input_ids)
        # A short tail joins the window before it, except in causal mode, where finished windows never change.
        min_window = 1 if self.is_causal else self.min_window_size
        full_windows, tail = divmod(self.seq_length, self.window_size)
        num_windows = full_windows + (tail >= min_window)
        self.parent.assertEqual(result.cells.shape, (self.batch_size, num_windows, self.hidden_size))
        self.parent.assertTrue(result.cells_mask.all())

    def create_and_check_padding_is_zero(self, config, input_ids, input_mask, sequence_labels, token_labels):
        model = RANModel(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask)
        padding = ~input_mask.bool()
        self.parent.assertTrue(torch.all(result.last_hidden_state[padding] == 0))

    def create_and_check_for_masked_lm(self, config, input_ids, input_mask, sequence_labels, token_labels):
        model = RANForMaskedLM(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        self.parent.assertEqual(result.loss.shape, ())

    def create_and_check_for_sequence_classification(
        self, config, input_ids, input_mask, sequence_labels, token_labels
    ):
        model = RANForSequenceClassification(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, labels=sequence_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.num_labels))
        self.parent.assertEqual(result.loss.shape, ())

    def create_and_check_for_token_classification(self, config, input_ids, input_mask, sequence_labels, token_labels):
        model = RANForTokenClassification(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.num_labels))
        self.parent.assertEqual(result.loss.shape, ())

    def create_and_check_for_causal_lm(self, config, input_ids, input_mask, sequence_labels, token_labels):
        model = RANForCausalLM(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, labels=input_ids)
        self.parent.assertEqual(result.loss.shape, ())
        if config.cutoffs is not None:  # the adaptive softmax scores the labels without the whole distribution
            self.parent.assertIsNone(result.logits)
            result = model(input_ids, attention_mask=input_mask)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))


class RANTesterMixin(ModelTesterMixin):
    """What every RAN test class shares: the tester, the config tests and RAN's place in the task tables."""

    model_tester_kwargs = {}
    # `_init_weights` covers every parameter; the check is otherwise reserved for models added since 2023.
    test_can_init_all_missing_weights_before_2023 = True
    # Not every parameter gets a gradient on every batch: the last layer's cell update reaches token outputs only
    # through a third window, which short random inputs may lack. The gradient-checkpointing tests still compare
    # which parameters get non-zero gradients with and without checkpointing.
    test_all_params_have_gradient = False

    def setUp(self):
        self.model_tester = RANModelTester(self, **self.model_tester_kwargs)
        self.config_tester = ConfigTester(self, config_class=RANConfig, hidden_size=37)
        # The mixin reads Transformers' built-in task tables (base models, which labels a head takes); RAN is
        # registered with the Auto classes only, so it joins those tables for the duration of each test.
        for table, model_class in TASK_TABLES:
            patcher = mock.patch.dict(table, {RANConfig.model_type: model_class.__name__})
            patcher.start()
            self.addCleanup(patcher.stop)

    def test_model_outputs_equivalence(self):
        # Same check as the mixin's, whose failure message subtracts every output pair (impossible for the bool
        # `cells_mask`); `assert_close` compares bool tensors exactly.
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(copy.deepcopy(config)).to(torch_device).eval()
            for return_labels, output_hidden_states in itertools.product((False, True), (False, True)):
                inputs = self._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
                with torch.no_grad():
                    tuple_output = model(**inputs, output_hidden_states=output_hidden_states, return_dict=False)
                    dict_output = model(**inputs, output_hidden_states=output_hidden_states, return_dict=True)
                self.assertIsInstance(tuple_output, tuple)
                torch.testing.assert_close(tuple_output, dict_output.to_tuple(), rtol=0, atol=1e-5)

    # The generation tests (with --transformers-tests): their inputs, and what `generate` returns in RAN's shapes.
    def prepare_config_and_inputs_for_generate(self, batch_size=2):
        config, inputs = super().prepare_config_and_inputs_for_generate(batch_size)
        config.bos_token_id = 1  # a text to start from when no prompt is given (`test_generate_without_input_ids`)
        return config, inputs

    def _check_attentions_for_generate(
        self, batch_size, attentions, prompt_length, output_length, config, decoder_past_key_values
    ):
        # RAN's attention weights are per window: over a whole text every token has the `key_length` columns of its
        # window (the cell and the window's slots); a decoding step's token reads the cell and its window's tokens so
        # far, itself included, as many columns as the row furthest into its window needs (padding is no token: a
        # row's window counts its real tokens, which the returned cache knows after the last step).
        self.assertIsInstance(attentions, tuple)
        self.assertEqual(len(attentions), output_length - prompt_length)
        heads = config.num_attention_heads
        for generated, step in enumerate(attentions):
            if decoder_past_key_values is not None and generated > 0:
                before = decoder_past_key_values.lengths - (len(attentions) - generated)  # tokens before this step's
                shape = (batch_size, heads, 1, 2 + int((before % config.window_size).max()))
            else:
                shape = (batch_size, heads, prompt_length + generated, self.model_tester.key_length)
            self.assertIsInstance(step, tuple)
            self.assertListEqual([layer.shape for layer in step], [shape] * config.num_hidden_layers)

    def _check_past_key_values_for_generate(self, batch_size, past_key_values, seq_length, config):
        # A `RANCache`: per layer a recurrent state (the cell) and the open window's keys and values, not keys and
        # values per token; it counts the positions it has read.
        self.assertIsInstance(past_key_values, RANCache)
        self.assertEqual(len(past_key_values), config.num_hidden_layers)
        self.assertEqual(past_key_values.get_seq_length(), seq_length)  # positions, padding included
        self.assertEqual(past_key_values.lengths.shape, (batch_size,))  # real tokens of each row
        self.assertTrue(bool((past_key_values.lengths <= seq_length).all()))
        slots = config.window_size + config.window_overlap  # the open window's tokens, after its enrichment ones
        heads, head_dim = config.num_attention_heads, config.head_dim
        finished = int(past_key_values.lengths.max()) // config.window_size
        for layer in past_key_values.layers:
            self.assertEqual(layer.cell.shape, (batch_size, config.hidden_size))
            self.assertEqual(layer.tail_keys.shape, (batch_size, slots, heads, head_dim))
            self.assertEqual(layer.tail_values.shape, (batch_size, slots, heads, head_dim))
            if config.memory_review:  # memory review's key and value of each finished window's cell
                self.assertEqual(layer.cell_states.shape[::2], (batch_size, 2 * config.hidden_size))
                self.assertGreaterEqual(layer.cell_states.shape[1], finished)

    def _check_caches_are_equal(self, cache1, cache2):
        # Two `RANCache`s: the same rows at the same places, and the same state in every layer.
        self.assertIsInstance(cache1, RANCache)
        self.assertIsInstance(cache2, RANCache)
        self.assertEqual(cache1.get_seq_length(), cache2.get_seq_length())
        torch.testing.assert_close(cache1.lengths, cache2.lengths)
        self.assertEqual(len(cache1), len(cache2))
        for layer1, layer2 in zip(cache1.layers, cache2.layers):
            torch.testing.assert_close(layer1.tensors(), layer2.tensors())

    # Tests that skip themselves with a reason about the tester ("does not support SDPA", "no `base_model_class`",
    # "does not have RoPE"): what RAN lacks is said here.
    def test_sdpa_can_dispatch_composite_models(self):
        self.skipTest("RAN is not a composite model: it has no sub-models whose attention could be set apart")

    def test_model_rope_scaling_frequencies(self):
        self.skipTest(NO_ROPE_SCALING)

    def test_model_rope_with_partial_rotation(self):
        self.skipTest("RAN's rotary embedding turns every pair of a head (no `partial_rotary_factor`)")

    def test_vision_axial_rope(self):
        self.skipTest("RAN reads text: it has no axial rotary embedding of image patches")

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_padding_is_zero(self):
        self.model_tester.create_and_check_padding_is_zero(*self.model_tester.prepare_config_and_inputs())


NO_ROPE_SCALING = "RAN's rotary embedding has no scaling (`rope_theta` only): its windows keep positions short"
for _name in [name for name in dir(ModelTesterMixin) if name.startswith("test_model_rope_scaling_from_config")]:
    setattr(RANTesterMixin, _name, lambda self: self.skipTest(NO_ROPE_SCALING))  # each parameterised case


class RANModelTest(RANTesterMixin, unittest.TestCase):
    all_model_classes = (RANModel, RANForMaskedLM, RANForSequenceClassification, RANForTokenClassification)

    def test_for_masked_lm(self):
        self.model_tester.create_and_check_for_masked_lm(*self.model_tester.prepare_config_and_inputs())

    def test_for_sequence_classification(self):
        self.model_tester.create_and_check_for_sequence_classification(*self.model_tester.prepare_config_and_inputs())

    def test_for_token_classification(self):
        self.model_tester.create_and_check_for_token_classification(*self.model_tester.prepare_config_and_inputs())


class RANCausalModelTest(RANTesterMixin, GenerationTesterMixin, unittest.TestCase):
    """The causal mode (`is_causal=True`): the bare model and the causal language model, which generates."""

    all_model_classes = (RANModel, RANForCausalLM)
    model_tester_kwargs = {"is_causal": True}

    def test_for_causal_lm(self):
        self.model_tester.create_and_check_for_causal_lm(*self.model_tester.prepare_config_and_inputs())


# The mixin again, with one option each. The option classes test the heads the option reaches (every head wraps the
# bare model, so one head covers it), which keeps each to a fraction of the default classes' time.


class RANAdaptiveSoftmaxModelTest(RANCausalModelTest):
    """Adaptive input embeddings and softmax (`cutoffs`, `div_val`): the causal LM only."""

    all_model_classes = (RANForCausalLM,)
    model_tester_kwargs = {"is_causal": True, "config_options": {"cutoffs": [20, 50], "div_val": 2}}

    @unittest.skip(
        reason="The adaptive input embedding is per-cluster embeddings and projections, not one nn.Embedding"
    )
    def test_model_get_set_embeddings(self):
        pass

    @unittest.skip(
        reason="An adaptive vocabulary cannot be resized: its clusters are cut at fixed ids (refused, named)"
    )
    def test_resize_tokens_embeddings(self):
        pass

    @unittest.skip(
        reason="The adaptive input embedding has no one `.weight` whose gradient the test reads (one per cluster)"
    )
    def test_enable_input_require_grads_with_gradient_checkpointing(self):
        pass


class RANAssociativeMemoryModelTest(RANCausalModelTest):
    """The delta-rule associative memory of every layer (causal only)."""

    all_model_classes = (RANForCausalLM,)
    model_tester_kwargs = {"is_causal": True, "config_options": {"associative_memory": True}}


class RANTokenShiftModelTest(RANModelTest):
    """`token_shift` on the encoder (the causal classes have it by default: their layer design turns it on)."""

    all_model_classes = (RANForMaskedLM,)
    model_tester_kwargs = {"config_options": {"token_shift": True}}


class RANInitialCellModelTest(RANModelTest):
    """An `initial_cell` given with every input: the first layer's first window reads it."""

    all_model_classes = (RANForSequenceClassification,)
    model_tester_kwargs = {"with_initial_cell": True}


class RANForPrefixLMWholeText(RANForPrefixLM, GenerationMixin):
    """The prefix LM as Transformers' generation tests read a decoder-only model: its `generate` returns the target
    only (as the encoder-decoders behind `AutoModelForSeq2SeqLM` do), where they expect the prompt, then what was
    generated. Here the prompt goes back in front; all the rest is the prefix LM's own `generate`."""

    def generate(self, inputs=None, generation_config=None, **kwargs):
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        output = super().generate(inputs, generation_config, **kwargs)
        if prompt is None:
            return output
        sequences = output if torch.is_tensor(output) else output.sequences
        whole = torch.cat([prompt.repeat_interleave(len(sequences) // len(prompt), dim=0), sequences], dim=1)
        if torch.is_tensor(output):
            return whole
        output.sequences = whole
        return output


class RANPrefixLMModelTest(RANModelTest, GenerationTesterMixin):
    """The prefix LM (`AutoModelForSeq2SeqLM`): five source tokens read both ways, then the target (its generation
    tests read `RANForPrefixLMWholeText`)."""

    all_model_classes = (RANForPrefixLM,)
    model_tester_kwargs = {"source_length": 5}


# Transformers' generation tests that cannot apply to RAN, each skipped with what RAN lacks. Set only on the tests the
# mixin has (none without --transformers-tests); tests whose own skip already names the lack keep it (assisted decoding
# of a stateful model, static caches, multi-token prediction, `position_ids`, graph breaks).
NO_FLASH_ATTENTION = (
    "RAN has no FlashAttention path: a token attends over its window's cell and slots in RAN's own attention "
    "(eager or SDPA), not through Transformers' attention interface"
)
GENERATION_SKIPS = {
    "test_custom_4d_attention_mask": "RAN takes a 2D padding mask only (a 4D one is refused, named): a token attends "
    "over its window's cell and slots, so a mask over every key of the sequence has nowhere to go",
    "test_eager_padding_matches_padding_free_with_position_ids": "RAN's forward has no `position_ids` parameter and no "
    "attention-interface backend, which this test needs; it reads packed rows from `position_ids` given as keyword "
    "arguments, through its window layout (tests/test_packed_documents.py compares them with the rows alone)",
    "test_generate_with_quant_cache": "RAN's cache holds a recurrent state and one open window's keys and values, not "
    "keys and values per token: a quantized key-value cache has nothing to quantize",
    "test_recurrent_layers_mask_padding_on_continued_forward": "RANConfig has no `layer_types`, by which this test "
    "finds recurrent layers (RAN's layers are all one kind: window attention around the recurrent cell); "
    "tests/test_causal_lm.py checks the same case, padding inside a continued chunk",
    "test_eager_matches_fa2_generate": NO_FLASH_ATTENTION,
    "test_eager_matches_fa3_generate": NO_FLASH_ATTENTION,
    "test_eager_matches_fa4_generate": NO_FLASH_ATTENTION,
    "test_flash_attention_2_continue_generate_with_position_ids": NO_FLASH_ATTENTION,
    **{
        f"test_flash_attention_{version}_padding_matches_padding_free_with_position_ids{kwargs}": NO_FLASH_ATTENTION
        for version in (2, 3, 4)
        for kwargs in ("", "_and_fa_kwargs")
    },
}
GENERATION_SKIPS["test_sdpa_padding_matches_padding_free_with_position_ids"] = GENERATION_SKIPS[
    "test_eager_padding_matches_padding_free_with_position_ids"
]
NO_DRAFTS = (
    "RAN refuses assisted and prompt-lookup decoding before any forward: rejected drafts would have to be cropped from "
    "its cache, and a recurrent state that has read them cannot be"
)
NO_PREFIX_LM_CACHE = (
    "RANForPrefixLM has no cache: every step reads the whole text again (source and target so far), so there are no "
    "past key values to return, continue from or draft against"
)
PREFIX_LM_SKIPS = {
    **dict.fromkeys(
        (
            "test_assisted_decoding_matches_greedy_search",
            "test_assisted_decoding_sample",
            "test_beam_search_generate_dict_outputs_use_cache",
            "test_greedy_generate_dict_outputs_use_cache",
            "test_generate_continue_from_past_key_values",
            "test_generate_continue_from_inputs_embeds",
            "test_past_key_values_format",
            "test_prompt_lookup_decoding_matches_greedy_search",
        ),
        NO_PREFIX_LM_CACHE,
    ),
    **dict.fromkeys(
        ("test_generate_from_inputs_embeds", "test_generate_from_random_inputs_embeds"),
        "RANForPrefixLM generates from token ids only: without a cache every step reads the whole text again, and a "
        "prompt given as `inputs_embeds` is not in the ids after the first step (refused, named)",
    ),
    "test_generate_without_input_ids": "RANForPrefixLM generates a target for a source and refuses a call without one, "
    "naming it: it has no decoder start of its own to begin a text from",
}


def skip_generation_tests(test_class, reasons: dict[str, str]) -> None:
    """Skip each named generation test of `test_class` (and each parameterised case of it) with its reason, and drop
    the names that hold no test: `@pytest.mark.generate` above `@parameterized.expand` leaves the bare name a pytest
    mark, which would pass without running anything (its cases are the test)."""
    for name in dir(GenerationTesterMixin):
        test = getattr(GenerationTesterMixin, name)
        if isinstance(inspect.unwrap(test), pytest.MarkDecorator):
            setattr(test_class, name, None)
            continue
        if not callable(test):  # (what `parameterized.expand` leaves of the name its cases replace)
            continue
        reason = reasons.get(name, reasons.get(re.sub(r"_\d+_\w+$", "", name)))  # `test_x_0_greedy`: a case of test_x
        if reason is not None:
            setattr(test_class, name, lambda self, *args, reason=reason: self.skipTest(reason))


if hasattr(GenerationTesterMixin, "prepare_config_and_inputs_for_generate"):  # Transformers' own mixin
    # (`test_prompt_lookup_decoding_matches_greedy_search` is decorated `@is_flaky` without its call, which makes it
    # pass without running: what it would meet is the refusal below.)
    CAUSAL_SKIPS = {**GENERATION_SKIPS, "test_prompt_lookup_decoding_matches_greedy_search": NO_DRAFTS}
    for _class in (RANCausalModelTest, RANAdaptiveSoftmaxModelTest, RANAssociativeMemoryModelTest):
        skip_generation_tests(_class, CAUSAL_SKIPS)
    skip_generation_tests(RANPrefixLMModelTest, {**GENERATION_SKIPS, **PREFIX_LM_SKIPS})
    RANPrefixLMModelTest.all_generative_model_classes = (RANForPrefixLMWholeText,)

    def caching_by_default(test):
        """`test` with the causal config asking every call for a cache (`use_cache=True`), as decoders' configs do."""

        def run(self, *args):
            self.model_tester.use_cache = True
            test(self, *args)

        return run

    # These two first check that a plain forward returns a cache, and skip (as for a model without one) where not.
    for _class in (RANCausalModelTest, RANAdaptiveSoftmaxModelTest, RANAssociativeMemoryModelTest):
        for _name in ("test_generate_continue_from_past_key_values", "test_generate_continue_from_inputs_embeds"):
            setattr(_class, _name, caching_by_default(getattr(GenerationTesterMixin, _name)))
