"""The Python API: `Generator` on the embedded model and its shipped heads."""

from __future__ import annotations

import dataclasses
import gc
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from amphista_jax import Generator, GeneratorError
from amphista_jax.engine.decode import generate, pad_prompts, speculative_generate
from amphista_jax.engine.decode_spec import bucket
from amphista_jax.engine.prompt_checks import PromptError
from amphista_jax.infra.compiled_programs import release_if_crowded
from amphista_jax.models.target import Target
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.tree import TreeError
from tests.helpers import count_compiles

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def push(self, x):"]


@pytest.fixture(scope="module")
def hydra():
    return Generator.load(heads="hydra", tree="small-8")


def test_speculative_generation_equals_plain_greedy_decoding(hydra):
    """Texts, ids and stop reasons of a batch equal the jitted AR loop's tokens on the same padded prompts."""
    out = hydra.generate(PROMPTS, max_new_tokens=24)
    ids = [hydra.encode(p) for p in PROMPTS]
    tokens, lengths = pad_prompts(ids, pad_id=hydra.pad_id)
    ar = generate(hydra.params, tokens, lengths, jax.random.key(0), config=hydra.config, max_new_tokens=24,
                  cache_size=tokens.shape[1] + 24, eos_ids=hydra.eos_ids, pad_id=hydra.pad_id)
    for row, got in enumerate(out.token_ids):
        assert got == [int(t) for t in ar.tokens[row, : int(ar.num_tokens[row])]]
        assert out.texts[row] == hydra.tokenizer.decode(got, skip_special_tokens=True)
    assert out.stop_reasons == ["eos" if t[-1] in hydra.eos_ids else "length" for t in out.token_ids]
    assert all(t > 1.0 for t in out.tau)  # trained heads commit more than one token per forward
    assert out.tokens_per_s > 0 and out.compile_seconds > 0
    assert hydra.autoregressive().generate(PROMPTS, max_new_tokens=24).token_ids == out.token_ids


def test_prompt_length_buckets_reuse_compiled_programs(hydra):
    """20 calls of mixed prompt lengths (3 buckets) compile 3 programs, each once."""
    lengths = [3, 9, 17, 30, 5, 40, 12, 33, 2, 16, 20, 7, 50, 11, 25, 60, 1, 14, 45, 8]
    assert sorted({bucket(n) for n in lengths}) == [16, 32, 64]
    gen = hydra.with_tree("chain-1")
    gen.generate([[5] * 4], max_new_tokens=8)  # the 16 bucket, and whatever else a first call compiles
    with count_compiles() as compiles:
        for n in lengths:
            gen.generate([list(range(3, 3 + n))], max_new_tokens=8)
    assert len(compiles) == 2  # the 32 and 64 buckets
    assert len([key for key in gen.target.programs if key[1] == gen.spec(8)]) == 3


def test_release_if_crowded_drops_a_targets_programs(hydra):
    """An evaluation keeps every method's generator alive, and their ahead-of-time compiled programs are out of
    `jax.clear_caches`' reach: `release_programs` drops them, those every other view of the target compiled too
    (without it a 13-method MT-Bench run died at 69% with "LLVM compilation error: Cannot allocate memory")."""
    gen, other = hydra.with_tree("chain-1"), hydra.with_tree("chain-2")
    first = gen.generate(PROMPTS[0], max_new_tokens=8).token_ids
    other.generate(PROMPTS[0], max_new_tokens=8)
    assert not release_if_crowded(gen.release_programs, share=1.0)  # below the limit: nothing is dropped
    trees = {key[1].tree for key in gen.target.programs}
    assert {gen.tree, other.tree} <= trees and other.target.programs is gen.target.programs
    assert release_if_crowded(gen.release_programs, share=0.0)
    assert not gen.target.programs
    assert gen.generate(PROMPTS[0], max_new_tokens=8).token_ids == first  # compiled again on demand
    assert len(gen.target.programs) == 1


@pytest.mark.slow
def test_greedy_stream_equals_generate(hydra):
    """Under -m slow: test_tree_search.py's test_generator_and_eval_follow_the_policy_by_batch checks that a greedy
    stream of the shipped heads joins to generate's text."""
    pieces = list(hydra.stream(PROMPTS[0], max_new_tokens=24, steps_per_chunk=2))
    assert len(pieces) > 1
    assert "".join(pieces) == hydra.generate(PROMPTS[0], max_new_tokens=24).texts[0]


def test_a_tree_the_heads_cannot_draft_is_refused_before_loading():
    with pytest.raises(TreeError, match="tree depth 9 needs 9 heads"):
        Generator.load(heads="hydra", tree="chain-9")


@pytest.mark.parametrize("call, message", [
    (lambda g: g.generate("x", temperature=-1.0), "temperature=-1.0: must be >= 0"),
    (lambda g: g.generate("x", top_k=10**9), "top_k=1000000000: must be in"),
    (lambda g: g.generate("x", max_new_tokens=0), "max_new_tokens=0: must be >= 1"),
    (lambda g: g.generate([[1, 2, 10**7]]), "token id 10000000 is outside the vocabulary"),
    (lambda g: g.generate([[]]), "empty prompt"),
    (lambda g: g.generate([]), "no prompts"),
    (lambda g: g.generate([1.5, 2.5]), "a prompt is a string, a list of chat messages"),
    (lambda g: g.stream("x", steps_per_chunk=0).__next__(), "steps_per_chunk=0"),
    (lambda g: g.generate(42), "got int"),
    (lambda g: g.for_batch(0), "for_batch(0): the batch size is a whole number of rows, at least 1"),
    (lambda g: g.for_batch(2.5), "for_batch(2.5)"),
])
def test_bad_calls_raise_typed_one_line_errors(hydra, call, message):
    with pytest.raises(GeneratorError, match=re.escape(message)) as e:
        call(hydra)
    assert "\n" not in str(e.value)


def test_unknown_heads_and_autoregressive_tree_are_refused(hydra):
    with pytest.raises(GeneratorError, match="neither a draft-head directory nor a method"):
        Generator.load(heads="no-such-method")
    with pytest.raises(GeneratorError, match="autoregressive decoding has no tree"):
        hydra.autoregressive().with_tree("chain-1")


def test_the_readme_python_example_runs_verbatim(capsys):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_a_method_name_without_trained_heads_gets_untrained_heads_that_decode_losslessly(tmp_path):
    from amphista_jax.assets import default_model_dir

    for f in default_model_dir().iterdir():  # the embedded model under another name: no heads shipped for it
        (tmp_path / f.name).symlink_to(f)
    gen = Generator.load(tmp_path, heads="medusa", tree="chain-2")
    assert gen.method == "medusa" and any("untrained" in n for n in gen.notes)
    out = gen.generate(PROMPTS[:2], max_new_tokens=12)
    ar = gen.autoregressive().generate(PROMPTS[:2], max_new_tokens=12)
    assert out.token_ids == ar.token_ids
    np.testing.assert_array_equal(out.output.num_tokens, ar.output.num_tokens)


@pytest.mark.parametrize("door", ["speculative_generate", "Generator.run"])
def test_another_drafters_params_are_refused_on_the_host(hydra, door):
    """Medusa's heads (or Hydra heads of another size) handed to a Hydra drafter: one typed line naming the first
    leaf that differs, not an error from inside the trace."""
    from amphista_jax.engine.prompt_checks import DraftParamsError

    medusa = Generator.load(heads="medusa", tree="chain-1").draft_params
    two_heads = dataclasses.replace(hydra.drafter, num_heads=2).init(jax.random.key(0),
                                                                     Target(hydra.config, hydra.params))
    tokens, lengths = pad_prompts([hydra.encode(PROMPTS[0])], pad_id=hydra.pad_id)
    for params, message in ((medusa, "missing ['head0']['in']"), (two_heads, "missing ['head2']")):
        with pytest.raises(DraftParamsError, match=re.escape(f"are not Hydra's params for this target ({message}")):
            if door == "speculative_generate":
                speculative_generate(hydra.params, params, tokens, lengths, jax.random.key(0), config=hydra.config,
                                     drafter=hydra.drafter, tree=hydra.tree, max_new_tokens=2, cache_size=128)
            else:
                hydra.with_drafter(hydra.drafter, hydra.tree, draft_params=params).run(
                    tokens, lengths, hydra.spec(2, SamplingConfig()))


@pytest.mark.parametrize("prompt, lengths, message", [
    ([1, 2, 3], [3], "[batch, length] integer array"),
    ([[1.0, 2.0]], [2], "[batch, length] integer array"),
    ([[1, 2]], [2, 2], "prompt_lengths must be 1 integers"),
    ([[1, 2]], [0], "must be in [1, 2]"),
    ([[1, 2]], [3], "must be in [1, 2]"),
    ([[1, 10**6]], [2], "token id 1000000 is outside the model's"),
    ([[1, -4]], [2], "token id -4 is outside the model's"),
], ids=["1-d", "float", "batch", "empty", "beyond", "id-high", "id-negative"])
@pytest.mark.parametrize("door", ["generate", "speculative_generate", "Generator.run"])
def test_the_jitted_doors_refuse_bad_prompts_on_the_host(hydra, door, prompt, lengths, message):
    """Inside jit a bad length or id is a garbage completion: every door checks concrete prompts first."""
    prompt, lengths, key = np.asarray(prompt), np.asarray(lengths), jax.random.key(0)
    kw = dict(config=hydra.config, max_new_tokens=2, cache_size=64)
    with pytest.raises(PromptError, match=re.escape(message)) as e:
        if door == "generate":
            generate(hydra.params, prompt, lengths, key, **kw)
        elif door == "speculative_generate":
            speculative_generate(hydra.params, hydra.draft_params, prompt, lengths, key, drafter=hydra.drafter,
                                 tree=hydra.tree, **kw)
        else:
            hydra.run(prompt, lengths, hydra.spec(2, SamplingConfig()))
    assert "\n" not in str(e.value)


def test_stop_ids_given_as_a_list_are_taken(hydra):
    """`eos_ids` is static under `jax.jit`, so it must hash: a list means the tuple of its ids."""
    tokens, lengths = pad_prompts([[5, 9, 33]])
    kw = dict(config=hydra.config, max_new_tokens=4, cache_size=64)
    listed = generate(hydra.params, tokens, lengths, jax.random.key(0), eos_ids=[2], **kw)
    np.testing.assert_array_equal(listed.tokens, generate(hydra.params, tokens, lengths, jax.random.key(0),
                                                          eos_ids=(2,), **kw).tokens)


def test_two_drafters_on_one_target_share_its_weights_and_programs():
    """Attaching drafters adds their params and nothing of the target's (measured over `jax.live_arrays`); every
    view compiles into the target's one cache, so the second drafter's autoregressive baseline compiles nothing."""
    def live_bytes() -> int:
        gc.collect()
        return sum(x.nbytes for x in jax.live_arrays())

    ar = Generator.load()
    before = live_bytes()
    hydra, medusa = ar.with_drafter("hydra", tree="chain-2"), ar.with_drafter("medusa", tree="chain-2")
    drafts = sum(x.nbytes for x in jax.tree.leaves((hydra.draft_params, medusa.draft_params)))
    target = sum(x.nbytes for x in jax.tree.leaves(ar.params))
    assert drafts <= live_bytes() - before < drafts + target // 10
    assert hydra.target is medusa.target is ar.target
    first = hydra.autoregressive().generate(PROMPTS[0], max_new_tokens=8)
    again = medusa.autoregressive().generate(PROMPTS[0], max_new_tokens=8)
    assert again.compile_seconds == 0 < first.compile_seconds and again.token_ids == first.token_ids
    for gen in (hydra, medusa):
        assert gen.generate(PROMPTS[0], max_new_tokens=8).token_ids == first.token_ids
    assert {hydra.drafter, medusa.drafter} <= {key[1].drafter for key in ar.target.programs}
