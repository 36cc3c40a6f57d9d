"""Shared fixtures. Eight emulated CPU devices for the sharding tests; fp32 everywhere."""

from __future__ import annotations

import os
import shutil
import tempfile

# Tests compile far more than they run, so XLA:CPU's LLVM runs at -O0: it compiles faster and the code runs slower,
# a net ~20% off a module's time (tests/test_hydra.py 73 -> 58 s). Tests compare programs compiled alike.
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in _flags:
        _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()
# The tests' default model is the embedded one (fast, nothing to fetch); users' is the real target
# (`fetch.default_model`), which tests/test_demo.py checks with this variable removed.
os.environ["AMPHISTA_MODEL"] = "tiny"
# The library keeps compiled programs under AMPHISTA_HOME (`infra.compile_cache`); tests keep their own (below), and
# their CLI subprocesses none, so no test reads a program another run compiled.
os.environ["AMPHISTA_COMPILE_CACHE"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

from amphista_jax.infra.compiled_programs import release_if_crowded  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Most of the suite's time is XLA:CPU compiling programs that earlier tests of the same worker compiled already: the
# same tiny models at the same shapes under a fresh `jax.jit`, or again after `release_if_crowded` dropped them. JAX's
# persistent compilation cache, keyed by the program and the JAX/XLA versions, hands them back. One directory per
# process and run, with no size cap: JAX then takes no lock and keeps no access times (a capped cache re-reads every
# entry's access time on each write, which made a full run slower), and no two processes write the same file. It
# goes at the end of the run. A hit still counts as a compile (`backend_compile_duration` wraps the lookup), so
# compile-count assertions hold. AMPHISTA_TEST_XLA_CACHE=0 turns it off; subprocesses (the CLI, real multi-process
# runs) do not use it.
XLA_CACHE = None if os.environ.get("AMPHISTA_TEST_XLA_CACHE") == "0" else tempfile.mkdtemp(prefix="amphista-xla-")
if XLA_CACHE:
    jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
    jax.config.update("jax_compilation_cache_max_size", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Parametrized cases outside a test's `helpers.default_cases` are slow: the default run keeps one per code
    path."""
    for item in items:
        keep = getattr(getattr(item, "function", None), "default_cases", None)
        if keep is not None and hasattr(item, "callspec"):
            if item.callspec.id not in keep:
                item.add_marker(pytest.mark.slow)
            unknown = keep - {i.callspec.id for i in items if getattr(i, "function", None) is item.function}
            if unknown and not any("::" in arg for arg in config.args):  # a node id collects only its own cases
                raise pytest.UsageError(f"{item.function.__name__}: default_cases names no case {sorted(unknown)}")


def pytest_sessionfinish(session, exitstatus):
    if XLA_CACHE:
        shutil.rmtree(XLA_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """One xdist worker running half the suite compiles enough programs to pass the kernel's memory-mapping limit
    (`amphista_jax.infra.compiled_programs`); after a test module, once past a third of it (the largest module adds
    ~23k mappings), drop JAX's compiled programs; below it they stay cached for later modules."""
    yield
    release_if_crowded()


# name -> (transformers config class, model class, config kwargs)
HF_VARIANTS = {
    "llama-mha": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, rope_theta=500000.0)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=6)),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2-untied": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False)),
}
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
            max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def build_hf_model(name: str, path, seed: int = 0):
    """Build a tiny random HF model of variant `name` in fp32, save it to `path`, return the torch model."""
    torch = pytest.importorskip("torch")
    import transformers

    cfg_cls, model_cls, kwargs = HF_VARIANTS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_cls)(**(TINY | kwargs))
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # HF zero-inits biases; random ones make the qkv-bias path observable
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.02)
    model.save_pretrained(path)
    return model


@pytest.fixture(params=sorted(HF_VARIANTS))
def hf_model(request, tmp_path):
    """(torch model, checkpoint dir) for each supported variant."""
    path = tmp_path / request.param
    return build_hf_model(request.param, path), path


SMOKE_OVERRIDES = [
    "max_files=30", "heldout_fraction=0.2", "vocab_size=300", "seq_len=32", "batch_size=4",
    "arch.hidden_size=32", "arch.intermediate_size=64", "arch.num_layers=2", "arch.num_heads=2",
    "arch.num_kv_heads=1", "eval_windows=4", "sample_tokens=8", "checkpoint_every=2",
    "optim.warmup_steps=1",
]


def smoke_pretrain_config(run_dir, steps: int):
    from amphista_jax.infra.config_io import load_config
    from amphista_jax.train.pretrain_target import PretrainConfig

    return load_config(PretrainConfig, None, SMOKE_OVERRIDES + [
        f"run_dir={run_dir}", f"export_dir={run_dir}/export", f"steps={steps}"])


@pytest.fixture(scope="session")
def smoke_model(tmp_path_factory):
    """A tiny target trained for 3 steps by the real recipe: (run dir, summary)."""
    from amphista_jax.train.pretrain_target import run

    run_dir = tmp_path_factory.mktemp("pretrain")
    return run_dir, run(smoke_pretrain_config(run_dir, steps=3))
