"""`placement.connect` against Ray's own errors, with `ray.init` replaced: a Ray Client
server that fails to set a session up is asked again, a bounded number of times; any
other failure is reported at once."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

from aici_cli.core.config import RayOptions  # noqa: E402
from aici_cli.core.errors import UsageError  # noqa: E402
from aici_cli.run.distributed import placement  # noqa: E402


class FakeInit:
    """`ray.init` that raises the given errors in turn, then connects."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = list(errors)
        self.calls: list[str | None] = []

    def __call__(self, address: str | None = None, **_: Any) -> None:
        self.calls.append(address)
        if self.errors:
            raise self.errors.pop(0)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(errors: list[BaseException]) -> FakeInit:
        init = FakeInit(errors)
        monkeypatch.setattr(placement.ray, "init", init)
        monkeypatch.setattr(placement.ray, "is_initialized", lambda: False)
        monkeypatch.setattr(placement.ray, "shutdown", lambda: None)
        monkeypatch.setattr(placement, "_client_token_auth", lambda: None)
        monkeypatch.setattr(placement, "CLIENT_INIT_BACKOFF_S", 0.0)
        return init
    return install


def options(address: str) -> RayOptions:
    return RayOptions(address=address)


SETUP_FAILED = ConnectionAbortedError("Initialization failure from server:\n")


@pytest.mark.parametrize("failures", range(placement.CLIENT_INIT_ATTEMPTS))
def test_a_client_session_that_fails_to_start_is_asked_again(fake: Any, failures: int) -> None:
    init = fake([SETUP_FAILED] * failures)
    assert placement.connect(options("ray://127.0.0.1:10001"), quiet=True) is True
    assert init.calls == ["ray://127.0.0.1:10001"] * (failures + 1)


def test_the_attempts_are_bounded_and_the_error_is_ray_s(fake: Any) -> None:
    init = fake([SETUP_FAILED] * (placement.CLIENT_INIT_ATTEMPTS + 1))
    with pytest.raises(UsageError, match="cannot connect: Initialization failure from server"):
        placement.connect(options("ray://127.0.0.1:10001"), quiet=True)
    assert len(init.calls) == placement.CLIENT_INIT_ATTEMPTS


@pytest.mark.parametrize("address,error", [
    ("ray://127.0.0.1:10001", ConnectionError("ray client connection timeout")),
    ("127.0.0.1:6379", ConnectionAbortedError("refused")),  # a GCS address: no retry
])
def test_other_failures_are_reported_at_once(fake: Any, address: str,
                                             error: BaseException) -> None:
    init = fake([error, error, error])
    with pytest.raises(UsageError, match="cannot connect"):
        placement.connect(options(address), quiet=True)
    assert len(init.calls) == 1
