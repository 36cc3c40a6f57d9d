"""amphista-jax: lossless speculative decoding with draft heads, in JAX/Flax.

The Python API is `Generator` (`generator.py`): `Generator.load(model, heads, tree)` once, then
`generate(prompts)` / `stream(prompt)`. Errors a caller can cause derive from `UserError` (`errors.py`).
"""

from amphista_jax.errors import UserError
from amphista_jax.generator import Generation, Generator, GeneratorError

__all__ = ["Generation", "Generator", "GeneratorError", "UserError"]
