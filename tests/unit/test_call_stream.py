"""How the router reads a model service's failures on its call stream: the stream breaking
(the service gone, whatever code the transport reports) is UNAVAILABLE; one answer's own error
keeps its status."""

import grpc
import pytest

from router.call_stream import CallStream
from tandem.errors import TandemError, Unavailable


@pytest.fixture
def stream():
    return CallStream(lambda: None, 1.0, "target service", "step_id")


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
def test_a_broken_stream_is_the_service_gone(stream, code):
    """A peer killed mid-stream ends it UNAVAILABLE ("Socket closed"), or INTERNAL / UNKNOWN
    when the connection is reset under the stream."""
    assert isinstance(stream.failed(code, "Stream removed", stream_broke=True), Unavailable)


def test_an_answers_own_error_keeps_its_status(stream):
    error = stream.failed(grpc.StatusCode.INTERNAL, "a bug on the target")
    assert not isinstance(error, Unavailable) and isinstance(error, TandemError) and "INTERNAL" in str(error)
    assert not isinstance(stream.failed(grpc.StatusCode.PERMISSION_DENIED, "not the router", stream_broke=True),
                          Unavailable)
