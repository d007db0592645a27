"""Fixtures for end-to-end tests against a real tritonserver on free loopback ports.

`triton_server_factory(model_repository, extra_args=(), env=None, model_parameters=None)`
starts a server (or returns the one already running with the same arguments) and gives back
a `TritonServer` with `.http_url`, `.grpc_url` (both host:port, as tritonclient expects), `.metrics_url` and
`.log_path`. `model_parameters={"gliner2": {"checkpoint": str(path)}}` overrides
parameters of the committed config.pbtxt (see `TritonServer`). Servers live for the whole session, because a start costs seconds: ask
for the same repository and arguments from several modules to share one. All are stopped
at session end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from manylora.tritonserver import TritonServer

FIXTURES = Path(__file__).parent / "fixtures"

TritonServerFactory = Callable[..., TritonServer]


def _freeze(mapping: Mapping | None) -> tuple:
    return tuple(sorted((k, _freeze(v) if isinstance(v, Mapping) else v) for k, v in (mapping or {}).items()))


@pytest.fixture(scope="session")
def triton_server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TritonServerFactory]:
    servers: dict[tuple, TritonServer] = {}
    log_dir = tmp_path_factory.mktemp("tritonserver")

    def start(
        model_repository: str | Path,
        *,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        model_parameters: Mapping[str, Mapping[str, str]] | None = None,
        timeout: float = 300.0,
    ) -> TritonServer:
        repository = Path(model_repository).resolve()
        key = (repository, tuple(extra_args), _freeze(env), _freeze(model_parameters))
        server = servers.get(key)
        if server is not None and server.running:
            return server
        server = TritonServer(
            repository,
            log_file=log_dir / f"{repository.name}-{len(servers)}.log",
            extra_args=extra_args,
            env=env,
            model_parameters=model_parameters,
        )
        server.start(timeout=timeout)
        servers[key] = server
        return server

    yield start
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def echo_server(triton_server_factory: TritonServerFactory) -> TritonServer:
    """The echo model repository, whose model.py imports manylora."""
    return triton_server_factory(FIXTURES / "echo_repo")
