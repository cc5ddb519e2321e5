"""LoRA adapters loaded the first time a request names them (vLLM's LoRA resolver), and
the confinement of every run-time load to ``lora_dir``.

With ``lora_load_on_demand`` (which needs ``allow_runtime_lora`` and ``lora_dir``), a
request whose ``model`` names neither the base model nor a served adapter, but a
directory ``<lora_dir>/<model>`` holding ``adapter_config.json``, has that directory
loaded as adapter ``<model>`` on every engine, as ``POST /v1/load_lora_adapter`` loads it
(`confined`, then `EngineClient.load_adapter`), and is then routed as usual. Only a name
that is one path component and a valid ``lora_name`` is looked up (a name with ``/`` or
``..`` names nothing: 404); a directory that leads outside ``lora_dir`` (a symbolic link,
itself or a file in it) is refused with a 403 naming the ``model`` (no path: the caller
need not be an admin); what the engines refuse is a 400 with their sentence. Requests
for the same new name while it loads wait for the one load (`LoraResolver.load`); a load
outlives the request that started it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

from radixserve.errors import ModelLoadError
from radixserve.protocol.lora_messages import LoraAdapterInfo
from radixserve.runtime.engine_client import EngineClient
from radixserve.services.gateway.server.errors import OpenAIError

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"  # what makes a directory a PEFT adapter
# a lora_name (`adapters.LoadLoraAdapterRequest`) that is also one path component
_NAME = re.compile(r"^[^=\s/\\]{1,256}$")


def confined(root: Path, given: str) -> Path:
    """``given`` (relative to ``root`` unless absolute) resolved, symbolic links followed:
    an adapter directory inside ``root`` whose files are all inside too; 403 naming it if
    it or a file in it leads outside, 400 if it is not a directory."""
    base = root.resolve(strict=True)
    raw = Path(given)
    resolved = (raw if raw.is_absolute() else base / raw).resolve()
    if not resolved.is_relative_to(base):
        raise OpenAIError(403, f"lora_path {given!r} resolves to {str(resolved)!r}, outside "
                          f"lora_dir {str(base)!r}", "lora_path")  # fmt: skip
    if not resolved.is_dir():
        raise OpenAIError(400, f"lora_path {given!r} is not a directory in lora_dir "
                          f"{str(base)!r}", "lora_path")  # fmt: skip
    for entry in resolved.iterdir():
        target = entry.resolve()
        if not target.is_relative_to(base):
            raise OpenAIError(403, f"lora_path {given!r} holds {entry.name!r}, a link to "
                              f"{str(target)!r} outside lora_dir {str(base)!r}",
                              "lora_path")  # fmt: skip
    return resolved


class LoraResolver:
    """Loads ``<lora_dir>/<name>`` as adapter ``name`` for the first request naming it
    (module notes). Owns only the loads in flight; what is served is the client's."""

    def __init__(self, client: EngineClient, lora_dir: Path) -> None:
        self._client = client
        self._root = lora_dir
        self._loading: dict[str, asyncio.Task[LoraAdapterInfo]] = {}  # name -> its load

    def _candidate(self, name: str) -> bool:
        """Whether ``name`` may name an adapter directory: one path component, a valid
        lora_name, holding adapter_config.json."""
        if not _NAME.fullmatch(name) or name in (".", ".."):
            return False
        return (self._root / name / ADAPTER_CONFIG).is_file()

    async def load(self, name: str) -> bool:
        """Serve ``<lora_dir>/<name>`` as adapter ``name`` (loading it, or waiting for the
        load in flight): True once served, False if there is no such adapter directory;
        OpenAIError 403 if it leads outside lora_dir, 400 if the engines refuse it."""
        task = self._loading.get(name)
        if task is None:
            if not self._candidate(name):
                return False
            try:
                path = confined(self._root, name)
            except OpenAIError:
                raise OpenAIError(403, f"The model `{name}` names an adapter directory in "
                                  "lora_dir that leads outside it: not loaded",
                                  "model") from None  # fmt: skip
            task = asyncio.ensure_future(self._client.load_adapter(name, str(path)))
            self._loading[name] = task
            task.add_done_callback(lambda done: self._finished(name, path, done))
        try:
            await asyncio.shield(task)  # a request that leaves does not cancel the load
        except ModelLoadError as exc:
            if name in self._client.adapters():  # loaded meanwhile by /v1/load_lora_adapter
                return True
            raise OpenAIError(400, f"LoRA adapter `{name}` was not loaded: {exc}",
                              "model") from None  # fmt: skip
        return True

    def _finished(self, name: str, path: Path, task: asyncio.Task[LoraAdapterInfo]) -> None:
        if self._loading.get(name) is task:
            del self._loading[name]
        if task.cancelled():
            return
        failure = task.exception()
        if failure is None:
            fingerprint = task.result().fingerprint[:19]
            logger.info("LoRA adapter %s loaded on demand from %s (%s)", name, path, fingerprint)
        else:
            logger.warning("LoRA adapter %s was not loaded on demand from %s: %s", name, path,
                           failure)  # fmt: skip
