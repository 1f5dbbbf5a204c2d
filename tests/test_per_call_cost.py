"""What a decoding step costs besides the model's arithmetic: Python calls beside Mamba-2's, host reads, and a
compiled step's graph (scripts/benchmarks/benchmark_per_call.py prints the figures and the times)."""

import benchmark_per_call
import pytest
import torch
from benchmark_kernels import KernelCounter
from benchmark_per_call import build, calls_per_step
from ran_testing import randomize_, tiny_config

from ran_hf import RANCache, RANForCausalLM


def width_128(name: str):
    """The causal RAN, Llama or Mamba-2 of benchmark_per_call.py's defaults (width 128, 2 layers, window 128)."""
    return build(name, benchmark_per_call.parse_args([]))


def calls_per_decoding_step(model) -> float:
    return calls_per_step(model, benchmark_per_call.parse_args(["--steps", "10"]))


def test_a_decoding_step_runs_at_most_twice_the_python_calls_of_mamba2():
    """A recurrent step should run about as much Python as another recurrent model's: within twice Mamba-2's,
    `generate()`'s own calls included on both sides."""
    ran, mamba = calls_per_decoding_step(width_128("ran")), calls_per_decoding_step(width_128("mamba2"))
    assert ran <= 2 * mamba, f"RAN {ran:.0f} Python calls per decoding step, Mamba-2 {mamba:.0f}"


def test_a_classifier_forward_runs_at_most_1_65_times_the_python_calls_of_llama():
    """A sequence classifier's forward pass over 512 tokens (four windows, two layers) runs within 1.65 times the
    Python calls of Llama's of the same width: the layout built once, no config work, no module called for nothing.
    (A config read costs three Python calls through Transformers' `__getattribute__`, as Llama's do: about 45 reads,
    135 of RAN's calls; a kernel-attachable op one more, for its dispatch: 18.)"""
    args = benchmark_per_call.parse_args([])
    ran, llama = benchmark_per_call.classifier_calls("ran", args), benchmark_per_call.classifier_calls("llama", args)
    assert ran <= 1.65 * llama, f"RAN {ran} Python calls per classifier forward, Llama {llama}"


def test_a_decoding_step_reads_nothing_to_the_host():
    """After the prompt's pass, a step of every layer runs on the device alone: counted on the meta device, which
    stands in for a GPU (a read there would have to wait for the device)."""
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True, window_size=4, min_window_size=2)))
    ids = torch.randint(1, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        model.to("meta")
        for layer in cache.layers:
            layer._map(lambda tensor: tensor.to("meta"))
        cache.lengths, cache.compiled_positions = cache.lengths.to("meta"), cache.compiled_positions.to("meta")
        counter = KernelCounter()
        token = torch.ones(2, 1, dtype=torch.long, device="meta")
        with counter:
            for _ in range(5):  # through the end of a window (lengths 7 -> 12, window 4)
                logits = model(token, past_key_values=cache, use_cache=True).logits
    assert logits.shape == (2, 1, 61)
    assert counter.host_syncs == 0
    assert cache.seen_positions == 12 and cache.known_lengths() == [12, 12]


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({}, id="learnable-memory"),
        pytest.param({"layer_design": "official", "window_overlap": 1}, id="official-overlap"),
        pytest.param({"memory_review_cells": 2}, id="bounded-memory"),
    ],
)
def test_a_compiled_decoding_step_runs_64_steps_in_one_graph(fields):
    """`torch.compile(fullgraph=True)` of the model's forward takes 64 single-token steps (16 windows end among them)
    without a graph break or a recompilation, and gives the eager steps' logits. With an unbounded memory, every step
    writes its cell into the cache's room in place: the room is not copied step after step."""
    torch._dynamo.reset()
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True, window_size=4, min_window_size=2, **fields)))
    ids = torch.randint(1, 61, (2, 70), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    eager_cache, compiled_cache = RANCache(model.config, max_cache_len=70), RANCache(model.config, max_cache_len=70)
    with torch.no_grad():
        model(ids[:, :6], past_key_values=eager_cache, use_cache=True)
        model(ids[:, :6], past_key_values=compiled_cache, use_cache=True)
        counts = torch._dynamo.utils.counters
        counts.clear()
        rooms = [layer.cell_states for layer in compiled_cache.layers]
        for position in range(6, 70):
            token = ids[:, position : position + 1]
            eager = model(token, past_key_values=eager_cache, use_cache=True).logits
            step = compiled(token, past_key_values=compiled_cache, use_cache=True).logits
            torch.testing.assert_close(step, eager, rtol=1e-4, atol=1e-4)
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])
    assert not counts["graph_break"], dict(counts["graph_break"])
    assert compiled_cache.get_seq_length() == 70 and compiled_cache.known_lengths() == [70, 70]
    if model.config.memory_review_cells is None:
        assert all(layer.cell_states is room for layer, room in zip(compiled_cache.layers, rooms))


@pytest.mark.slow
def test_generate_compiles_the_decoding_step_through_transformers_compile_path():
    """Given a `RANCache` and a `CompileConfig`, `generate()` runs its decoding steps compiled (on a CPU too, where it
    compiles only when asked): one graph for all of them, and the tokens of eager decoding."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True, window_size=4, min_window_size=2)))
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    compile_config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    compile_config._compile_all_devices = True
    with torch.no_grad():
        eager = model.generate(ids, max_new_tokens=20, do_sample=False)
        torch._dynamo.utils.counters.clear()
        cache = RANCache(model.config)
        compiled = model.generate(
            ids, max_new_tokens=20, do_sample=False, past_key_values=cache, compile_config=compile_config
        )
    assert torch.equal(compiled, eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_is_causal_set_by_transformers_on_every_call_costs_no_config_work(monkeypatch):
    """Transformers' defaults merger sets `config.is_causal` (to the value it holds) around every forward: that is no
    edit, so the config is not checked again nor its layer design resolved; a caller's `is_causal=False` on a causal
    model is still refused, naming the field, and the model runs on after it."""
    from ran_hf import RANConfig

    model = RANForCausalLM(tiny_config(is_causal=True)).eval()
    ids = torch.randint(1, 61, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids)
        edits, config_work = model.config.edits, []
        for owner, method in ((RANConfig, "validate"), (RANConfig, "_follow_design")):
            original = getattr(owner, method)

            def counted(*args, _original=original, _name=method):
                config_work.append(_name)
                return _original(*args)

            monkeypatch.setattr(owner, method, counted)
        cache = model(ids, use_cache=True).past_key_values
        for _ in range(3):
            model(ids[:, :1], past_key_values=cache, use_cache=True)
        assert config_work == [] and model.config.edits == edits
        with pytest.raises(ValueError, match="`is_causal` was changed from True to False"):
            model(ids, is_causal=False)
        assert model.config.is_causal and model(ids).logits.shape == (1, 9, 61)
