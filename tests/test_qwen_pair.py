"""The Qwen2.5-Coder pair, fetched from its split wheels (1.6 GB; `-m slow` only): both converted models' logits
equal `transformers`' `Qwen2ForCausalLM` (fp32, every position), the 1.5B's greedy chat answer equals
`transformers.generate` token for token, and the 0.5B drafting for the 1.5B (a chain, with and without the
confidence stop) writes that same answer.

Covered by default on small random models: Qwen2 parity with tied and untied projections and qkv bias
(`test_hf_parity.py`, variants `qwen2-tied` and `qwen2-untied`), the split-wheel fetch
(`test_fetch.py::test_parts_from_a_folder_join_and_convert`), a draft model's lossless decoding
(`test_draft_model.py::test_greedy_draft_model_equals_ar`) and the confidence stop
(`test_draft_model.py::test_the_confidence_stop_is_lossless_and_saves_unsure_depths`).

AMPHISTA_TEST_HOME=DIR reuses (or fills) a data home across runs instead of fetching into a temporary one.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub

import gc  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from amphista_jax.models.fetch import resolve_model  # noqa: E402
from amphista_jax.models.hf import load_params  # noqa: E402
from amphista_jax.models.llama import Transformer  # noqa: E402
from amphista_jax.models.tokenizer import encode_prompt, load_tokenizer  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AMPHISTA_HOME", os.environ.get("AMPHISTA_TEST_HOME") or str(tmp_path_factory.mktemp("home")))
        yield {name: resolve_model(name) for name in (TARGET, DRAFT)}


def _torch_model(path: str):
    return transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@pytest.mark.parametrize("name", [TARGET, DRAFT])
def test_logits_match_transformers(home, name):
    path = home[name]
    ids = encode_prompt(load_tokenizer(path), PROMPT, chat=True)
    model = _torch_model(path)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.numpy()[0]
    del model
    gc.collect()
    params, config = load_params(path)
    assert config.model_type == "qwen2" and config.qkv_bias and config.num_kv_heads == 2
    ours = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray([ids]),
                                                jnp.arange(len(ids))[None]).logits[0])
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_answer_matches_transformers_and_the_draft_model_keeps_it(home):
    from amphista_jax import Generator

    path = home[TARGET]
    ids = encode_prompt(load_tokenizer(path), PROMPT, chat=True)
    model = _torch_model(path)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW_TOKENS, top_p=None, top_k=None, temperature=None)
    ref = ref.numpy()[0, len(ids):].tolist()
    del model
    gc.collect()
    ar = Generator.load(path)
    assert ar.generate([ids], max_new_tokens=NEW_TOKENS).token_ids[0] == ref
    for p_min in (0.0, 0.4):
        spec = ar.with_drafter(home[DRAFT], tree="chain-6", settings={"p_min": p_min} if p_min else None)
        out = spec.generate([ids], max_new_tokens=NEW_TOKENS)
        assert out.token_ids[0] == ref and out.tau[0] > 2.0, (p_min, out.tau)
