"""What the config schemas share (:mod:`serve_app.common.config`,
:mod:`~serve_app.common.variant_config`, :mod:`~serve_app.common.tenant_config`): the pattern
of route, application, tenant and adapter names, the upper bounds of the config's numbers, and
the check for names listed twice."""

from __future__ import annotations

import re

# Route and application names end up in URLs, metric labels and `route:adapter` model ids.
# Matched whole (pydantic's `pattern`, `re.fullmatch`): `$` alone lets a trailing newline pass.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
#: Upper bounds of the config's numbers: far above any real setting, and small enough that
#: every figure derived from them per request (token buckets in float, weight sums) is finite.
MAX_WEIGHT = 1_000_000
MAX_CONCURRENT_REQUESTS = 1_000_000
MAX_REQUESTS_PER_MINUTE = 1_000_000_000
MAX_TOKENS_BUDGET = 10**15  # tokens per minute or per day


def check_name(what: str, name: str) -> None:
    """Raise ``ValueError`` unless ``name`` matches :data:`NAME_PATTERN` whole."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise ValueError(f"{what} {name!r} must match {NAME_PATTERN} (letters, digits, '.', "
                         "'_', '-'; at most 64)")


def duplicates(names: list[str]) -> list[str]:
    """Names that occur more than once, sorted."""
    return sorted({n for n in names if names.count(n) > 1})

