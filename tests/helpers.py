"""What the tests share: the tiny target's prompts, heads fitted to its own continuations, prefill + commit
replays against a known sequence, compile counting, the chi-square statistic, a small code corpus, and the
environment of the CLI run in subprocesses (one CPU device each, as `jax.distributed` processes)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from amphista_jax.drafters.base import Drafter, PrefillContext, Proposal
from amphista_jax.engine.decode import generate, pad_prompts, speculative_generate
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import Output, Transformer
from amphista_jax.models.target import Target
from amphista_jax.train.step import make_steps, target_forward
from amphista_jax.trees.tree import TreeSpec, batched, chain, tree_arrays
from amphista_jax.trees.verify import Verdict

ROOT = Path(__file__).parents[1]
CONFIG = tiny_llama_config()
PROMPTS = [[5, 9, 33, 8, 1, 77, 4, 3, 100], [11, 12], [200, 1, 2, 3, 4]]



def default_cases(*ids: str) -> Callable[[Callable], Callable]:
    """Keep only these parametrized cases (pytest ids, e.g. "medusa-small-8") of the decorated test in the default
    run; `conftest.pytest_collection_modifyitems` marks its other cases slow (`-m slow` runs them). Each case kept
    exercises a distinct code path; the test's docstring says why the others add no mechanism to them."""
    def mark(test: Callable) -> Callable:
        test.default_cases = frozenset(ids)
        return test
    return mark


# chi-square critical values at p = 0.001 for the degrees of freedom the tests use
CHI2_999 = {7: 24.32, 15: 37.70}


def chi2_999(dof: int) -> float:
    """The chi-square critical value at p = 0.001 (Wilson-Hilferty; within 1% of the table for dof >= 7)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + 3.0902 * np.sqrt(h)) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def reference_rows(ar: Any, prompts: Sequence[Sequence[int]], width: int) -> jax.Array:
    """`[B, width]` each prompt followed by its AR continuation (zeros after)."""
    ref = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ref[row, : len(prompt)] = prompt
        generated = np.asarray(ar.tokens[row])
        ref[row, len(prompt): len(prompt) + len(generated)] = generated
    return jnp.asarray(ref)


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
    """Collects one entry per XLA backend compilation inside the block."""
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    try:
        yield compiles
    finally:
        jax.monitoring.clear_event_listeners()


def sequence(target: Target, batch: int, length: int, seed: int = 3) -> tuple[jax.Array, jax.Array]:
    """Random tokens `[B, T]` and the target's hidden states over them `[B, T, D]`."""
    tokens = jax.random.randint(jax.random.key(seed), (batch, length), 0, target.config.vocab_size)
    return tokens, target_forward(Transformer(target.config), target.params, {"tokens": tokens}).hidden


def fitted_heads(drafter: Any, target: Target, steps: int = 150, lr: float = 1e-2,
                 metric: str = "head3/top1", threshold: float = 0.9) -> Any:
    """Heads fitted to the target's own greedy continuations of PROMPTS (self-distillation, as the papers
    train; only the continuation's tokens are labels, where the ground truth is the teacher's argmax): a
    random target's continuations cannot be learned in general, but fitted ones make the drafts right often,
    so decoding runs long accepted paths through the method's commits. `metric` must end above `threshold`."""
    tokens, lengths = pad_prompts(PROMPTS)
    ar = generate(target.params, tokens, lengths, jax.random.key(0), config=target.config, max_new_tokens=40,
                  cache_size=64)
    seqs, mask = np.zeros((len(PROMPTS), 56), np.int32), np.zeros((len(PROMPTS), 56), np.int32)
    for row, prompt in enumerate(PROMPTS):
        seq = list(prompt) + np.asarray(ar.tokens[row]).tolist()
        seqs[row, : len(seq)], mask[row, len(prompt): len(seq)] = seq, 1
    optimizer = optax.adamw(lr)
    params = drafter.init(jax.random.key(0), target)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    step, _ = make_steps(Transformer(target.config), drafter, optimizer)
    for _ in range(steps):
        state, metrics = step(state, target.params, {"tokens": seqs, "loss_mask": mask})
    assert float(metrics[metric]) > threshold, float(metrics[metric])
    return state["params"]


def assert_trains(drafter: Any, target: Target, steps: int = 8, lr: float = 3e-3) -> None:
    """A few train steps on random sequences lower the held-fixed batch's loss (and keep it finite)."""
    optimizer = optax.adamw(lr)
    params = drafter.init(jax.random.key(0), target)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    step, evaluate = make_steps(Transformer(target.config), drafter, optimizer)
    tokens, _ = sequence(target, batch=4, length=24)
    batch = {"tokens": np.asarray(tokens), "loss_mask": np.ones(tokens.shape, np.int32)}
    before = float(evaluate(state["params"], target.params, batch)["loss"])
    for _ in range(steps):
        state, metrics = step(state, target.params, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert float(evaluate(state["params"], target.params, batch)["loss"]) < before - 0.05


def replay_commits(drafter: Any, params: Any, target: Target, tokens: jax.Array, hidden: jax.Array,
                   lengths: Sequence[int], counts: Sequence[Sequence[int]],
                   check: Callable[[Any, jax.Array], None], pad: int = 16, depth: int = 4) -> None:
    """Prefill `lengths [B]` tokens of a known sequence (`tokens [B, T]`, target hidden `[B, T, D]`; padded
    prompt slots hold garbage), then commit `counts[i] [B]` accepted tokens per row through chain trees whose
    nodes hold the sequence's own tokens and hidden states; `check(state, lengths)` after every step."""
    b = tokens.shape[0]
    lengths = jnp.asarray(lengths)
    slots = jnp.arange(pad)[None] < lengths[:, None]
    prompt = jnp.where(slots, tokens[:, :pad], 0)
    out = Output(jnp.where(slots[:, :, None], hidden[:, :pad], 9.0), None, None)
    root = jnp.take_along_axis(tokens, lengths[:, None], 1)[:, 0]
    state = jax.jit(drafter.prefill)(params, target, PrefillContext(out, prompt, lengths, root),
                                     drafter.init_state(target.config, b, 64))
    commit = jax.jit(drafter.commit)
    check(state, lengths)
    for step_counts in counts:
        a = jnp.asarray(step_counts)
        node_pos = lengths[:, None] + jnp.arange(depth + 1)[None]  # [B, D+1] node i = the token at lengths + i
        proposal = Proposal(jnp.take_along_axis(tokens, node_pos, 1), batched(tree_arrays(chain(depth)), b))
        verify_out = Output(jnp.take_along_axis(hidden, node_pos[:, :, None], 1), None, None)
        nodes = jnp.where(jnp.arange(depth + 1)[None] < a[:, None], jnp.arange(depth + 1)[None], -1)
        bonus = jnp.take_along_axis(tokens, (lengths + a)[:, None], 1)[:, 0]
        state, next_hidden = commit(params, target, proposal, Verdict(nodes, a, bonus), verify_out, state)
        lengths = lengths + a
        for cache in state["caches"]:
            np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(lengths))
        np.testing.assert_allclose(np.asarray(next_hidden),
                                   np.asarray(jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], 1)[:, 0]))
        check(state, lengths)


def assert_compiles_once(target_params: Any, drafter: Any, params: Any, tree: Any, max_new_tokens: int = 24) -> None:
    """Speculative generation compiles once for prompts of other lengths and contents at one padded shape."""
    kw = dict(config=CONFIG, drafter=drafter, tree=tree, max_new_tokens=max_new_tokens, cache_size=96)
    with count_compiles() as compiles:
        for prompts in (PROMPTS, [[1, 2], [3] * 9, [4, 5, 6]]):
            tokens, lengths = pad_prompts(prompts, length=16)
            jax.block_until_ready(speculative_generate(target_params, params, tokens, lengths, jax.random.key(0),
                                                       **kw))
    assert len(compiles) == 1


def assert_greedy_lossless(target: Target, drafter: Any, params: Any, tree: TreeSpec, trained: bool) -> None:
    """Greedy speculative decoding == AR token for token, batch 3 (`PROMPTS`) and batch 1; trained heads
    on a tree deeper than the root must also commit more than 1.5 tokens per target forward."""
    for prompts in (PROMPTS, PROMPTS[1:2]):
        tokens, lengths = pad_prompts(prompts)
        ar = generate(target.params, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=40,
                      cache_size=64)
        spec = speculative_generate(target.params, params, tokens, lengths, jax.random.key(0), config=CONFIG,
                                    drafter=drafter, tree=tree, max_new_tokens=40, cache_size=128)
        np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
        np.testing.assert_array_equal(np.asarray(spec.num_tokens), np.asarray(ar.num_tokens))
    if trained and tree.depth > 1:
        tau = 39 / int(spec.steps)
        assert tau > 1.5, tau  # the drafts are used: accepted paths longer than the root alone


def subprocess_env() -> dict[str, str]:
    """This environment for a subprocess running the CLI: one CPU device, this checkout importable, no
    distributed job unless a launcher sets one."""
    env = dict(os.environ) | {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "PYTHONPATH": str(ROOT)}
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def write_code_files(directory: Path, n: int = 30) -> Path:
    """`n` small Python modules in `directory` (created): a `data.kind=text` training set."""
    directory.mkdir(parents=True)
    for i in range(n):
        (directory / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" * 6)
    return directory


class ReferenceOracle(Drafter):
    """A test drafter whose params are the reference rows it reads its drafts from (prompt + AR continuation):
    nothing to initialise or train."""

    name = "oracle"

    def init(self, rng, target):
        raise NotImplementedError("an oracle's params are its reference rows (tests.helpers.reference_rows)")

    def param_trees(self, target):
        return ()  # given token rows: no param layout to check

    def loss(self, params, target, batch, target_out):
        raise NotImplementedError("an oracle is not trained")
