"""What differs between the transformers releases kvstack supports, in one place.

transformers 5.24 renamed the cache argument of a model's ``forward`` (and ``generate``) from
``past_key_values`` to ``cache``. The old name still works there, with a FutureWarning, and is
the only one before. Code that passes a cache by keyword asks :func:`cache_keyword` which name
to use, so it runs on both sides of the rename without the warning.
"""

from __future__ import annotations

import inspect
from typing import Any


def cache_keyword(model: Any) -> str:
    """The name ``model``'s ``forward`` takes its cache by: ``"cache"`` where the model's
    class has that parameter (transformers >= 5.24), else ``"past_key_values"``."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
