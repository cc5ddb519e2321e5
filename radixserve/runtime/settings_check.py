"""``radixserve <service> --check-config``: a service's settings as it would start with
them, started nothing.

Builds the service's settings classes from the environment (and the command's flags)
exactly as the service does, refuses what the service would refuse at start (a
non-loopback address without the cluster secret or, for the gateway, API keys), and
refuses ``RADIXSERVE_*`` variables that no service's settings, nor the process itself, read: a misspelt name in a compose file or a
Kubernetes manifest would otherwise be ignored silently. Another service's settings are
let through, since one environment (a ConfigMap) often serves them all. A deployment check runs this against the
built image with each container's command and environment.
"""

from __future__ import annotations

import difflib
import importlib
import os
from typing import Any

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from radixserve.errors import RadixServeError
from radixserve.runtime.settings import ServiceSettings, WorkerSettings, resolved_tp

#: read by the process outside the settings classes (module docstrings say where)
PROCESS_VARIABLES = frozenset({
    "RADIXSERVE_LOG_LEVEL",  # radixserve.logging
    "RADIXSERVE_NATIVE_KERNELS",  # radixserve.kernels.cpu.native
    "RADIXSERVE_NATIVE_DIR",  # radixserve.kernels.cpu.native
})  # fmt: skip


#: each service's own settings class (in ``radixserve.services.<service>.settings``), and
#: whether the engine's settings configure it too
_OWN_SETTINGS = {
    "kvstore": ("KVStoreSettings", False),
    "prefill": ("PrefillSettings", True),
    "decode": ("DecodeSettings", True),
    "gateway": ("GatewaySettings", True),
    "autoscaler": ("AutoscalerSettings", False),
}
SERVICES = tuple(_OWN_SETTINGS)


class UnknownSettingError(RadixServeError):
    """A RADIXSERVE_* variable that nothing in the service reads."""


def settings_classes(service: str) -> list[type[BaseSettings]]:
    """The settings classes ``service`` is configured by (its probe's included)."""
    from radixserve.runtime.probe import ProbeSettings
    from radixserve.settings import EngineSettings

    if service not in _OWN_SETTINGS:
        raise ValueError(f"no such service: {service}")
    name, engine = _OWN_SETTINGS[service]
    own = getattr(importlib.import_module(f"radixserve.services.{service}.settings"), name)
    return [EngineSettings, own, ProbeSettings] if engine else [own, ProbeSettings]


def field_variables(cls: type[BaseSettings]) -> dict[str, set[str]]:
    """Field -> the environment variables that set it (prefix + name, or its aliases)."""
    prefix = str(cls.model_config.get("env_prefix", ""))
    out: dict[str, set[str]] = {}
    for field, info in cls.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            out[field] = {str(c).upper() for c in alias.choices if str(c).isupper()}
        else:
            out[field] = {f"{prefix}{field}".upper()}
    return out


def variable_names(cls: type[BaseSettings]) -> set[str]:
    """The environment variables ``cls`` reads."""
    return set().union(*field_variables(cls).values())


def check_config(service: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Every settings object of ``service`` as JSON-able dicts, keyed by class name.

    Raises UnknownSettingError for a RADIXSERVE_* variable nothing reads, and pydantic's
    ValidationError for a value a setting refuses (the CLI reports both)."""
    classes = settings_classes(service)
    # one environment often serves every service (a compose anchor, a Kubernetes
    # ConfigMap): another service's setting is not a mistake, a name nothing reads is
    every = {c for name in SERVICES for c in settings_classes(name)}
    known = set(PROCESS_VARIABLES).union(*(variable_names(c) for c in every))
    unknown = sorted(k for k in os.environ if k.startswith("RADIXSERVE_") and k not in known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise UnknownSettingError(
            f"no radixserve service reads a setting named {', '.join(hints)}; "
            f"`radixserve {service} --check-config` with none set prints {service}'s settings"
        )
    out: dict[str, Any] = {}
    for cls in classes:
        fields = set(cls.model_fields)
        values = {k: v for k, v in overrides.items() if k in fields}
        if values.get("tp") == "auto" and not issubclass(cls, WorkerSettings):
            values["tp"] = resolved_tp("auto")  # the engine's size: what the worker resolves
        settings = cls(**values)
        # what the service refuses at start: no authentication beyond loopback
        if isinstance(settings, ServiceSettings):
            settings.require_secure(service)
        elif hasattr(settings, "require_secure"):  # the gateway's
            settings.require_secure()
        # secrets never print: the cluster secret is left out, API keys show masked
        out[cls.__name__] = settings.model_dump(mode="json", exclude={"cluster_secret"})
    return out
