"""ftjax: run Mixture-of-Experts LLMs larger than accelerator memory on one accelerator
plus host RAM, in JAX. See README.md for the architecture."""

from ftjax.engine.session import Session, Snapshot
from ftjax.engine.state_cache import StateCache
from ftjax.model import Model, load

__all__ = ["Model", "Session", "Snapshot", "StateCache", "load"]
__version__ = "0.1.0"
