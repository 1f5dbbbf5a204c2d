"""`torch.compile` of a RAN: graph breaks only where the window layout is built, none inside a layer; no new graph
for a new number of windows once two have been seen (the cell scan is one custom op, not a loop unrolled per window);
compiled outputs and gradients equal eager ones.

The backends here are dynamo's capture alone (`CompileCounter`) and `aot_eager` (adds AOTAutograd: the custom op's
fake shapes and its registered backward), which compile in seconds; inductor is measured by
scripts/benchmarks/benchmark_compile.py, and run here once, for generation."""

import pytest
import torch
import torch._dynamo
from ran_testing import pad_batch, random_ids, randomize_, tiny_config
from torch._dynamo.testing import CompileCounter

from ran_hf import RANForCausalLM, RANModel


pytestmark = pytest.mark.slow  # inductor compiles each graph for seconds to minutes

TOLERANCE = 1e-5
# Lengths of 4, 6 and 9 windows of 5 tokens.
LENGTHS = [18, 28, 43]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("scan", ["reference", "fused"])
def test_graph_breaks_only_where_the_layout_is_built(scan):
    model = randomize_(RANModel(tiny_config(scan_implementation=scan)))
    explanation = torch._dynamo.explain(model)(random_ids(LENGTHS[0], 61, seed=0)[None])
    assert explanation.graph_break_count <= 3
    for reason in explanation.break_reasons:
        functions = [frame.name for frame in reason.user_stack]
        assert "from_attention_mask" in functions, f"graph break outside the layout: {reason.reason} at {functions}"


@pytest.mark.parametrize("scan", ["reference", "fused"])
def test_a_third_window_count_compiles_no_new_graph(scan):
    model = randomize_(RANModel(tiny_config(scan_implementation=scan)))
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    frames = []
    for length in LENGTHS:
        ids = random_ids(length, 61, seed=length)[None]
        with torch.no_grad():
            got = compiled(ids).last_hidden_state
            want = model(ids).last_hidden_state
        assert (got - want).abs().max() <= TOLERANCE
        frames.append(counter.frame_count)
    assert frames[2] == frames[1], f"frames compiled after each window count: {frames}"


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
def test_compiled_training_matches_eager(dropout):
    """aot_eager: the scan op's fake shapes and backward, with padding (left) and three window counts per batch;
    with dropout, whose masks the scan op takes as inputs, the same seed drops the same units."""
    config = tiny_config(
        scan_implementation="fused", hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout
    )
    model = randomize_(RANModel(config), seed=2).train()
    compiled = torch.compile(model, backend="aot_eager")
    for lengths in ([17, 6, 11], [23, 9, 14]):
        ids, mask = pad_batch([random_ids(n, 61, seed=n) for n in lengths], side="left")
        results = []
        for run in (compiled, model):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            outputs = run(ids, attention_mask=mask)
            (outputs.last_hidden_state.pow(2).sum() + outputs.pooler_output.sum()).backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            results.append((outputs.last_hidden_state.detach(), grads))
        (got, got_grads), (want, want_grads) = results
        assert (got - want).abs().max() <= TOLERANCE
        assert got_grads.keys() == want_grads.keys()
        for name, expected in want_grads.items():
            diff = (got_grads[name] - expected).abs().max().item()
            assert diff <= TOLERANCE * max(1.0, expected.abs().max().item()), f"gradient of {name}: {diff:.2e}"


def test_generate_on_an_inductor_compiled_model_matches_eager():
    """Greedy decoding through a compiled forward, across window boundaries, with two layers reading cached cells.

    Inductor, not a lighter backend: a miscompilation of the cached cells' merge showed only there."""
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True)), seed=0).eval()
    prompt = random_ids(13, model.config.vocab_size, seed=1)[None]  # windows of 5: decoding finishes two more
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    model.forward = torch.compile(model.forward, backend="inductor")
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), expected)


def test_torch_export_gives_one_program_for_any_batch_size_and_length():
    """The exported layout is sized from the input's shape and the scan is one `scan` operator, so the program
    traced on one batch runs others (padding on either side, lengths that are not a multiple of the window)."""
    model = randomize_(RANModel(tiny_config()), seed=2).eval()
    ids, mask = pad_batch([random_ids(13, 61, seed=0), random_ids(9, 61, seed=1)], side="left")
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence", min=2)
    with torch.no_grad():
        program = torch.export.export(
            model, (ids,), {"attention_mask": mask}, dynamic_shapes=({0: batch, 1: sequence}, {0: batch, 1: sequence})
        ).module()
        for lengths, side in (([18, 28, 43], "right"), ([4], "right"), ([7, 30], "left")):
            ids, mask = pad_batch([random_ids(n, 61, seed=n) for n in lengths], side=side)
            expected, exported = model(ids, attention_mask=mask), program(ids, attention_mask=mask)
            for name in ("last_hidden_state", "pooler_output", "last_cell"):
                torch.testing.assert_close(exported[name], expected[name], atol=TOLERANCE, rtol=0)
