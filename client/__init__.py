"""Python client and CLI for the ManyLoRA GLiNER2 Triton model.

    from manylora.client import ManyLoRAClient
    with ManyLoRAClient("localhost:8001", adapter="acme-ner") as client:
        client.extract_entities("Tim Cook runs Apple.", ["person", "company"])

Names load lazily: the server imports ``manylora.client.protocol`` (numpy only) and
must not pull in tritonclient or gliner2 through this package.
"""

_EXPORTS = {
    "ManyLoRAClient": "client",
    "AsyncManyLoRAClient": "aio",
    "ManyLoRAError": "errors",
    "SchemaError": "errors",
    "Request": "protocol",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
