"""The API key file (`GatewaySettings.api_key_file`, a mounted Secret): the same JSON list
of entries as ``RADIXSERVE_GATEWAY_API_KEYS``, or one bare key per line."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from radixserve.services.gateway.tenancy.tenants import ApiKey

_ENTRIES = TypeAdapter(list[ApiKey])


def read_key_file(path: Path | None) -> list[ApiKey]:
    """The keys of an API key file (see `GatewaySettings.api_key_file`); ValueError naming
    the file (never a key) when it cannot be read or holds a bad entry."""
    if path is None:
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"api_key_file {path}: cannot read it ({exc.__class__.__name__})"
        ) from None
    stripped = text.strip()
    try:
        if stripped.startswith("["):
            return _ENTRIES.validate_python(json.loads(stripped))
        lines = [line.strip() for line in text.splitlines()]
        return _ENTRIES.validate_python([x for x in lines if x and not x.startswith("#")])
    except json.JSONDecodeError as exc:
        raise ValueError(f"api_key_file {path}: not a JSON list (line {exc.lineno})") from None
    except ValidationError as exc:
        problems = "; ".join(f"entry {'.'.join(map(str, e['loc']))}: {e['msg']}"
                             for e in exc.errors())  # fmt: skip
        raise ValueError(f"api_key_file {path}: {problems}") from None
