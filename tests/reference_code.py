"""The reference packages' own model code (`tests/reference-packages.txt`: medusa-llm 0.1, eagle-llm 1.2.1, dflash
0.1.0, speculators 0.9.0, installed without their dependencies), with each fix they need to run here named where it
is applied. None of them changes what a model computes:

1. medusa-llm builds a tokenizer from the hub in its model constructor (`MedusaModel.__init__`): it is not used by a
   forward, and no hub is reachable here, so it is None (the peers benchmark's engine side sets the target's own).
2. eagle-llm's draft attention (`cnets.LlamaAttention._init_rope`) reads `config.rope_scaling["type"]`; transformers 5
   fills `rope_scaling` with `{"rope_theta", "rope_type"}` where a config names none, which transformers 4 left None:
   such a default is put back to None (the plain RoPE it means).
3. speculators imports `openai`, `datasets` and `hs_connectors` at import time (its data pipeline) and `loguru` when
   loading; where they are not installed they are empty modules (no forward touches them).
4. speculators' `Eagle3DraftModel.load_verifier_weights` looks a verifier up on the hub even when none is named (its
   base class returns early; the subclass does not): it returns early too.
5. speculators fills the weights its checkpoint leaves out (`embed_tokens`: the verifier's) only where they are
   still NaN after `from_pretrained`; under transformers 5.25 (it pins <= 5.19) they are sometimes initialised
   instead, so some loads draft from a random embedding: `eagle3_from_pretrained` fills them from the verifier.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

import pytest

INSTALL = "pip install --no-deps --require-hashes -r tests/reference-packages.txt"


def _installed(package: str) -> None:
    """Skip the test, naming the install command, where `package` is not installed (the README's test command
    installs it)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the reference package {package} is not installed: {INSTALL}")


def _need(module: str) -> types.ModuleType:
    _installed(module.split(".")[0])
    return importlib.import_module(module)


class _NoTokenizer:
    @staticmethod
    def from_pretrained(*args: object, **kwargs: object) -> None:
        return None


def _no_hub_tokenizer(module: types.ModuleType) -> None:  # fix 1: the module's name, not transformers' class
    module.AutoTokenizer = _NoTokenizer


def medusa_model() -> types.ModuleType:
    """`medusa.model.medusa_model` (MedusaModel, MedusaConfig, ResBlock)."""
    module = _need("medusa.model.medusa_model")
    _no_hub_tokenizer(module)
    return module


def eagle_cnets() -> types.ModuleType:
    """`eagle.model.cnets` (Model: the EAGLE-1 draft) with `eagle.model.configs.EConfig` as `cnets.EConfig`."""
    cnets = _need("eagle.model.cnets")
    from amphista_jax.evals.peer_engines.eagle import fix_draft_rope_scaling

    fix_draft_rope_scaling()  # fix 2: the peers benchmark's engine side needs it too
    return cnets


def dflash_model() -> types.ModuleType:
    """`dflash.model` (DFlashDraftModel): runs as released."""
    return _need("dflash.model")


def _empty_module(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attrs.items():
        setattr(module, key, value)
    sys.modules[name] = module
    return module


def speculators() -> types.ModuleType:
    """`speculators` (Eagle3DraftModel, DFlashDraftModel, their converters), offline."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    _need("transformers")
    if "speculators" not in sys.modules:
        _installed("speculators")  # without importing it: its imports need the modules below first
        names = {"openai": ("AsyncOpenAI", "OpenAI", "AsyncClient", "Client"),  # fix 3
                 "datasets": ("Dataset",), "hs_connectors": ("FileTransfer", "HiddenStatesTransfer",
                                                             "HiddenStatesBackend")}
        for name, classes in names.items():
            if importlib.util.find_spec(name) is None:
                module = _empty_module(name, **{c: type(c, (), {}) for c in classes})
                if name == "openai":
                    module.types = _empty_module("openai.types")
                    module.types.chat = _empty_module("openai.types.chat", ChatCompletion=type("C", (), {}),
                                                      ChatCompletionMessageParam=type("P", (), {}))
                    module.types.completion = _empty_module("openai.types.completion", Completion=type("C", (), {}))
                if name == "datasets":
                    module.load_from_disk = module.load_dataset = module.concatenate_datasets = None
        if importlib.util.find_spec("loguru") is None:

            class _Quiet:
                def __getattr__(self, name: str) -> object:
                    return lambda *args, **kwargs: None

            _empty_module("loguru", logger=_Quiet())
    import speculators as spec
    from speculators.models.eagle3 import core

    if not getattr(core.Eagle3DraftModel.load_verifier_weights, "fixed", False):  # fix 4
        load = core.Eagle3DraftModel.load_verifier_weights

        def load_verifier_weights(self: object) -> None:
            if self.config.speculators_config.verifier.name_or_path is not None:
                load(self)

        load_verifier_weights.fixed = True
        core.Eagle3DraftModel.load_verifier_weights = load_verifier_weights
    return spec


def eagle3_from_pretrained(path: object) -> object:
    """speculators' `Eagle3DraftModel.from_pretrained(path)` (eager attention), its embedding the verifier's (fix 5)."""
    model = speculators().Eagle3DraftModel.from_pretrained(path, attn_implementation="eager").eval()
    model._load_verifier_weights(overwrite_embed_tokens=True)
    return model
