"""Draft methods. Each module defines one `Drafter` (`base.py`), registered by its `name` (`@Drafter.register`):
`DRAFTERS` maps each name to its class, and a train config's `drafter: {type: <name>, <settings>}` builds it."""

from amphista_jax.drafters.amphista import Amphista
from amphista_jax.drafters.base import DraftContext, Drafter, Proposal
from amphista_jax.drafters.bita import BiTA
from amphista_jax.drafters.dflash import DFlash
from amphista_jax.drafters.draft_model import DraftModel
from amphista_jax.drafters.eagle import Eagle
from amphista_jax.drafters.eagle3 import Eagle3
from amphista_jax.drafters.gumiho import Gumiho
from amphista_jax.drafters.hydra import Hydra
from amphista_jax.drafters.medusa import Medusa
from amphista_jax.drafters.prompt_lookup import PromptLookup
from amphista_jax.drafters.sar import SemiAutoregressive

# The methods by name (`Drafter.register`'s, sorted): those whose heads `amphista-jax train` writes (a draft model
# made from the target's first layers among them; one with its own checkpoint loads from it instead), and those with
# nothing to train (`trainable` False: prompt lookup).
DRAFTERS: dict[str, type[Drafter]] = dict(Drafter.config_types())
# Each method's default settings, and the named variants that are settings of a method (Hydra++).
VARIANTS: dict[str, Drafter] = {"medusa": Medusa(), "amphista": Amphista(), "hydra": Hydra(),
                                "hydra++": Hydra.plus_plus(), "eagle": Eagle(), "eagle3": Eagle3(), "gumiho": Gumiho(),
                                "sar": SemiAutoregressive(), "sar-lstm": SemiAutoregressive(encoder="lstm"),
                                "bita": BiTA(), "dflash": DFlash(), "prompt_lookup": PromptLookup(),
                                "draft_model": DraftModel()}

__all__ = ["DRAFTERS", "VARIANTS", "Amphista", "BiTA", "DFlash", "DraftContext", "DraftModel", "Drafter", "Eagle",
           "Eagle3", "Gumiho", "Hydra", "Medusa", "PromptLookup", "Proposal", "SemiAutoregressive"]
