"""linalg lowerings of slicing, concatenation, padding, gather/scatter and arg-reductions."""
from __future__ import annotations
