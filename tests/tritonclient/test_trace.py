"""Triton's trace extension, driven by tritonclient's get_trace_settings and
update_trace_settings (HTTP and gRPC). kiln runs with no trace flags: Triton's
defaults (level OFF, rate 1000, no count limit), in OpenTelemetry mode."""

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

DEFAULTS = {
    "trace_level": ["OFF"],
    "trace_rate": "1000",
    "trace_count": "-1",
    "log_frequency": "0",
    "trace_file": "",
    "trace_mode": "opentelemetry",
}


def test_trace_settings_http(http_url):
    client = httpclient.InferenceServerClient(http_url)
    assert client.get_trace_settings() == DEFAULTS
    changed = client.update_trace_settings(
        model_name="echo",
        settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "10", "trace_count": "5"},
    )
    assert changed["trace_level"] == ["TIMESTAMPS"]
    assert changed["trace_rate"] == "10"
    assert changed["trace_count"] == "5"
    assert client.get_trace_settings(model_name="echo") == changed
    # The server's settings stay; None clears the model's: it follows them again.
    assert client.get_trace_settings() == DEFAULTS
    cleared = client.update_trace_settings(
        model_name="echo",
        settings={"trace_level": None, "trace_rate": None, "trace_count": None},
    )
    assert cleared == DEFAULTS
    # A client never names a file.
    with pytest.raises(InferenceServerException, match="cannot be set by a request"):
        client.update_trace_settings(settings={"trace_file": "/tmp/trace.json"})
    with pytest.raises(InferenceServerException):
        client.get_trace_settings(model_name="no-such-model")
    assert client.get_trace_settings() == DEFAULTS
    client.close()


def test_trace_settings_grpc(grpc_url):
    client = grpcclient.InferenceServerClient(grpc_url)
    got = client.get_trace_settings(as_json=True)
    assert {k: v["value"] for k, v in got["settings"].items()} == {
        k: v if isinstance(v, list) else [v] for k, v in DEFAULTS.items()
    }
    changed = client.update_trace_settings(
        model_name="echo-multi", settings={"trace_rate": "4", "trace_level": "TIMESTAMPS"}
    )
    assert list(changed.settings["trace_rate"].value) == ["4"]
    assert list(changed.settings["trace_level"].value) == ["TIMESTAMPS"]
    model = client.get_trace_settings(model_name="echo-multi")
    assert list(model.settings["trace_rate"].value) == ["4"]
    cleared = client.update_trace_settings(
        model_name="echo-multi", settings={"trace_rate": None, "trace_level": None}
    )
    assert list(cleared.settings["trace_rate"].value) == ["1000"]
    assert list(cleared.settings["trace_level"].value) == ["OFF"]
    with pytest.raises(InferenceServerException) as refused:
        client.update_trace_settings(settings={"trace_file": "/etc/passwd"})
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    client.close()
