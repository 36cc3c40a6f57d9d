"""amphista-jax: lossless speculative decoding with draft heads, in JAX/Flax.

The Python API is `Generator` (`facade/generator.py`): `Generator.load(model, heads, tree)` once, then
`generate(prompts)` / `stream(prompt)`; weights in hand load through `LoadedTarget.from_params`. Errors a caller
can cause derive from `UserError` (`infra/errors.py`).
"""

from amphista_jax.facade.generator import Generation, Generator, GeneratorError
from amphista_jax.facade.target import LoadedTarget
from amphista_jax.infra.errors import UserError

__all__ = ["Generation", "Generator", "GeneratorError", "LoadedTarget", "UserError"]
