"""jnova's version, in a module every layer may import (the caches' keys include it)."""
__version__ = "0.1.0"
