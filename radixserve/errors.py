"""Error types shared by the library, the CLI and the services.

Recoverable per-request errors (bad input, a request that cannot fit) derive from
`RequestError` and become an error reply; everything else is a fault of the process.
"""


class RadixServeError(Exception):
    """Base class of every error radixserve raises on purpose."""


class RequestError(RadixServeError):
    """A single request cannot be served; the engine and other requests carry on."""


class InvalidRequestError(RequestError):
    """The request is malformed or out of range (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownAdapterError(InvalidRequestError, ValueError):
    """The request names a LoRA adapter the engine does not serve (`param` "model"); the
    API answers it as an unknown model (HTTP 404)."""


class CapacityError(RequestError):
    """The request can never fit in the KV pool as configured."""


class UnavailableError(RadixServeError):
    """The serving workers cannot take or finish a request now (HTTP 503): none is up,
    one died mid-request, or a transfer between them failed. Retrying later may work."""


class ModelLoadError(RadixServeError):
    """A model path is missing, unreadable, corrupt or of an unsupported kind."""


class ConfigurationError(RadixServeError, ValueError):
    """Settings that cannot work on this machine (a kernel set or CUDA graphs without the
    device they need); the process exits with the message."""


class UsageError(RadixServeError):
    """A command-line flag or combination of flags a command does not take."""
