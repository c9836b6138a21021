"""Triton's logging extension as tritonclient uses it: `get_log_settings` and
`update_log_settings` over HTTP and gRPC, unmodified. kiln runs with the default
settings (`--log-level info`, no log file); each test puts back what it changed."""

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

DEFAULTS = {
    "log_file": "",
    "log_info": True,
    "log_warnings": True,
    "log_errors": True,
    "log_verbose_level": 0,
    "log_format": "default",
}


def test_http_log_settings(http_url):
    client = httpclient.InferenceServerClient(http_url)
    assert "logging" in client.get_server_metadata()["extensions"]
    assert client.get_log_settings() == DEFAULTS
    try:
        changed = client.update_log_settings({"log_verbose_level": 1, "log_format": "ISO8601"})
        assert changed == {**DEFAULTS, "log_verbose_level": 1, "log_format": "ISO8601"}
        assert client.get_log_settings() == changed
        # What a client read can be sent back whole: the log file is its own value.
        assert client.update_log_settings(changed) == changed
        with pytest.raises(InferenceServerException) as e:
            client.update_log_settings({"log_file": "/tmp/kiln-elsewhere.log"})
        assert e.value.status() == "400", e.value.message()
        assert "--log-file" in e.value.message()
        assert client.get_log_settings() == changed
    finally:
        assert client.update_log_settings(DEFAULTS) == DEFAULTS
        client.close()


def test_grpc_log_settings(grpc_url):
    client = grpcclient.InferenceServerClient(grpc_url)
    assert client.get_log_settings(as_json=True)["settings"] == {
        "log_file": {"string_param": ""},
        "log_info": {"bool_param": True},
        "log_warnings": {"bool_param": True},
        "log_errors": {"bool_param": True},
        "log_verbose_level": {"uint32_param": 0},
        "log_format": {"string_param": "default"},
    }
    try:
        changed = client.update_log_settings({"log_info": False, "log_verbose_level": 2})
        assert changed.settings["log_info"].bool_param is False
        assert changed.settings["log_verbose_level"].uint32_param == 2
        assert changed.settings["log_warnings"].bool_param is True
        with pytest.raises(InferenceServerException) as e:
            client.update_log_settings({"log_format": "xml"})
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT", e.value.status()
        read = client.get_log_settings()
        assert read.settings["log_format"].string_param == "default"
        assert read.settings["log_verbose_level"].uint32_param == 2
    finally:
        client.update_log_settings(DEFAULTS)
        assert client.get_log_settings(as_json=True)["settings"]["log_info"] == {"bool_param": True}
        client.close()
