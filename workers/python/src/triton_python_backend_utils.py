"""kiln's `triton_python_backend_utils`: the module that `model.py` files written for
Triton's python backend import (as `pb_utils`), with the same names and behaviour.

Embedded in the python worker plugin and registered in `sys.modules` before the
model is imported. The `_kiln_*` functions at the end are the worker's side: the
Rust plugin builds the requests and reads the responses through them.
Not supported (see docs/writing-a-worker.md, "Workers in Python"): DLPack and GPU
tensors, decoupled mode (response senders, `exec(decoupled=True)`), model
warmup, request cancellation checks (always False). `async_exec` runs its call
when awaited, one at a time."""

import asyncio
import inspect
import json
import struct

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

# kiln's datatype names (the KServe v2 protocol's) and Triton's config names.
_NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}

# The same as numpy dtypes, looked up once (per tensor, `np.dtype(...)` showed in
# the python echo's profile).
_DTYPES = {name: np.dtype(numpy_type) for name, numpy_type in _NUMPY.items()}


def triton_string_to_numpy(triton_type_string):
    """`TYPE_FP32` (a model config's data_type) to `numpy.float32`."""
    name = triton_type_string[5:] if triton_type_string.startswith("TYPE_") else triton_type_string
    if name == "STRING":
        name = "BYTES"
    return _NUMPY.get(name)


def numpy_to_triton_type(data_type):
    """A numpy type to Triton's config name without `TYPE_` (`FP32`), or None."""
    if data_type in (np.object_, np.bytes_) or np.dtype(data_type).kind in "OSU":
        return "BYTES"
    for name, numpy_type in _NUMPY.items():
        if np.dtype(numpy_type) == np.dtype(data_type):
            return name
    return None


def serialize_byte_tensor(input_tensor):
    """A numpy array of bytes/str/objects to Triton's BYTES wire form (each element
    a 4-byte little-endian length and its bytes), as a uint8 array."""
    if input_tensor.size == 0:
        return np.empty([0], dtype=np.uint8)
    parts = []
    for obj in np.nditer(input_tensor, flags=["refs_ok"], order="C"):
        item = obj.item()
        if not isinstance(item, bytes):
            item = str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(item)))
        parts.append(item)
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor):
    """Triton's BYTES wire form to a 1-D numpy object array of bytes."""
    data = memoryview(encoded_tensor).cast("B")
    items, at = [], 0
    while at + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, at)
        items.append(bytes(data[at + 4 : at + 4 + n]))
        at += 4 + n
    return np.array(items, dtype=np.object_)


class TritonError:
    """An error one response carries (`InferenceResponse(error=...)`)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message, code=INTERNAL):
        self._message = str(message)
        self._code = code

    def message(self):
        return self._message

    def code(self):
        return self._code

    def __str__(self):
        return self._message

    def __repr__(self):
        return f"TritonError({self._message!r}, {self._code})"


class TritonModelException(Exception):
    """Raised by a model to fail the whole batch (as any exception does)."""

    def __init__(self, message=""):
        super().__init__(message)
        self._message = str(message)

    def message(self):
        return self._message


class Tensor:
    """A named tensor: `Tensor(name, numpy_array)`; `as_numpy()` gives the array."""

    def __init__(self, name, array):
        if not isinstance(array, np.ndarray):
            raise TritonModelException(f"Tensor `{name}`: expected a numpy array, got {type(array).__name__}")
        self._name = name
        self._array = array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array

    def shape(self):
        return list(self._array.shape)

    def triton_dtype(self):
        return numpy_to_triton_type(self._array.dtype)

    def is_cpu(self):
        return True

    def to_dlpack(self):
        raise TritonModelException("kiln's python worker does not support DLPack")

    @staticmethod
    def from_dlpack(name, capsule):
        raise TritonModelException("kiln's python worker does not support DLPack")


class InferenceRequest:
    """One client request of the batch handed to `execute`, or one built to call
    another model (BLS): `exec()` runs it through the server and answers an
    `InferenceResponse` (an error response when the call fails)."""

    def __init__(self, model_name="", inputs=None, requested_output_names=None, **kwargs):
        self._model_name = model_name
        self._inputs = list(inputs or [])
        self._requested = list(requested_output_names or [])
        self._id = kwargs.get("request_id", "")
        self._correlation_id = kwargs.get("correlation_id", 0)
        self._timeout = int(kwargs.get("timeout", 0) or 0)
        self._parameters = kwargs.get("parameters", {})
        if not isinstance(self._parameters, str):
            self._parameters = json.dumps(self._parameters)

    def inputs(self):
        return self._inputs

    def requested_output_names(self):
        return self._requested

    def request_id(self):
        return self._id

    def correlation_id(self):
        return self._correlation_id

    def parameters(self):
        return self._parameters

    def model_name(self):
        return self._model_name

    def is_cancelled(self):
        return False

    def get_response_sender(self):
        raise TritonModelException("kiln's python worker does not support decoupled models")

    def exec(self, decoupled=False):
        if decoupled:
            raise TritonModelException("kiln's python worker does not support decoupled model calls")
        return _kiln_exec(self)

    async def async_exec(self, decoupled=False):
        """Runs the call when awaited (calls of one `execute` run one at a time)."""
        return self.exec(decoupled)


class InferenceResponse:
    """`InferenceResponse(output_tensors=[...], error=None)`: one per request."""

    def __init__(self, output_tensors=None, error=None, parameters=None):
        self._output_tensors = list(output_tensors or [])
        self._error = error

    def output_tensors(self):
        return self._output_tensors

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


def get_input_tensor_by_name(inference_request, name):
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response, name):
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config, name):
    for entry in model_config.get("input", []):
        if entry["name"] == name:
            return entry
    return None


def get_output_config_by_name(model_config, name):
    for entry in model_config.get("output", []):
        if entry["name"] == name:
            return entry
    return None


class ModelConfig:
    """The config handed to `TritonPythonModel.auto_complete_config`, which may add
    inputs, outputs and a max batch size that config.toml does not declare."""

    def __init__(self, model_config):
        if isinstance(model_config, str):
            model_config = json.loads(model_config)
        self._model_config = model_config

    def as_dict(self):
        return self._model_config

    def max_batch_size(self):
        return self._model_config.get("max_batch_size", 0)

    def set_max_batch_size(self, max_batch_size):
        self._model_config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self):
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input):
        self._add("input", input)

    def add_output(self, output):
        self._add("output", output)

    def add_model_warmup(self, model_warmup):
        raise TritonModelException("kiln's python worker does not support model warmup")

    def set_model_transaction_policy(self, transaction_policy_dict):
        if transaction_policy_dict.get("decoupled"):
            raise TritonModelException("kiln's python worker does not support decoupled models")

    def _add(self, kind, tensor):
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise TritonModelException(f"{kind} {tensor!r} has no `{key}`")
        entries = self._model_config.setdefault(kind, [])
        for entry in entries:
            if entry["name"] == tensor["name"]:
                same = entry["data_type"].removeprefix("TYPE_") == tensor["data_type"].removeprefix("TYPE_")
                if not same or [int(d) for d in entry["dims"]] != [int(d) for d in tensor["dims"]]:
                    raise TritonModelException(
                        f"{kind} `{tensor['name']}` is declared as {entry} and added as {tensor}"
                    )
                return
        entries.append({"name": tensor["name"], "data_type": tensor["data_type"], "dims": list(tensor["dims"])})


class Logger:
    """Triton's `pb_utils.Logger`: records go to the server's log."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3

    @staticmethod
    def log(message, level=0):
        _kiln_log(level, str(message))

    @staticmethod
    def log_info(message):
        _kiln_log(Logger.INFO, str(message))

    @staticmethod
    def log_warn(message):
        _kiln_log(Logger.WARNING, str(message))

    @staticmethod
    def log_error(message):
        _kiln_log(Logger.ERROR, str(message))

    @staticmethod
    def log_verbose(message):
        _kiln_log(Logger.VERBOSE, str(message))


def _kiln_log(level, message):
    """Replaced by the worker with its logger (the server's log)."""


def _kiln_call(model, inputs, outputs, timeout_us):
    """Replaced by the worker with its model call (see `_kiln_exec`)."""
    raise TritonModelException("model calls are not available here")


# ---- the worker's side --------------------------------------------------------


def _kiln_requests(inputs, requested, parameters):
    """The batch's `InferenceRequest`s, one per client request, from one call per
    batch (not one per tensor: each call from the worker costs more than the loop
    here). `inputs`: per input, (name, datatype, [memory], [shape]) with one memory
    and shape per request; `parameters`: per request, its parameters' JSON. Each
    input is a read-only numpy view of the batch's memory (no copy), BYTES an
    object array of bytes."""
    tensors = [[] for _ in parameters]
    for name, datatype, memories, shapes in inputs:
        if datatype == "BYTES":
            for held, memory, shape in zip(tensors, memories, shapes):
                held.append(Tensor(name, deserialize_bytes_tensor(memory).reshape(shape)))
        else:
            dtype = _DTYPES[datatype]
            for held, memory, shape in zip(tensors, memories, shapes):
                held.append(Tensor(name, np.frombuffer(memory, dtype=dtype).reshape(shape)))
    return [
        InferenceRequest(inputs=held, requested_output_names=requested, parameters=p)
        for held, p in zip(tensors, parameters)
    ]


def _kiln_auto_complete(model_class, model_config):
    """Triton's auto-completion: the config JSON after the model's
    `auto_complete_config` (a static method) added to it."""
    config = model_class.auto_complete_config(ModelConfig(model_config))
    if not isinstance(config, ModelConfig):
        raise TritonModelException(
            f"auto_complete_config returned {type(config).__name__}, not the ModelConfig it was given"
        )
    return json.dumps(config.as_dict())


def _kiln_exec(request):
    """`request.exec()`: its inputs as (name, datatype, shape, bytes), the call,
    and its answer as an InferenceResponse (an error one when it failed)."""
    model = request.model_name()
    if isinstance(model, (bytes, bytearray, np.bytes_)):
        model = bytes(model).decode("utf-8", "replace")
    inputs = []
    for tensor in request.inputs():
        array = tensor.as_numpy()
        datatype = numpy_to_triton_type(array.dtype)
        if datatype is None:
            raise TritonModelException(f"input `{tensor.name()}`: numpy type {array.dtype} has no Triton datatype")
        if datatype == "BYTES":
            data = serialize_byte_tensor(array)
        else:
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        inputs.append((tensor.name(), datatype, list(array.shape), memoryview(data)))
    answer = _kiln_call(str(model), inputs, [str(n) for n in request.requested_output_names()], request._timeout)
    if isinstance(answer, tuple):
        code, message = answer
        return InferenceResponse(error=TritonError(message, code))
    tensors = []
    for name, datatype, shape, data in answer:
        if datatype == "BYTES":
            array = deserialize_bytes_tensor(data).reshape(shape)
        elif datatype in _NUMPY:
            array = np.frombuffer(data, dtype=_NUMPY[datatype]).reshape(shape)
        else:
            error = TritonError(f"output `{name}` of `{model}` is {datatype}, which numpy has no type for")
            return InferenceResponse(error=error)
        tensors.append(Tensor(name, array))
    return InferenceResponse(output_tensors=tensors)


_loop = None


def _kiln_run(coroutine):
    """Runs an `async def execute` to its end on this interpreter's event loop."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
    return _loop.run_until_complete(coroutine)


class _ResponseError(Exception):
    pass


def _kiln_output(response, name, datatype):
    tensor = get_output_tensor_by_name(response, name)
    if tensor is None:
        raise _ResponseError(f"the response has no output `{name}`")
    array = tensor.as_numpy()
    if datatype == "BYTES":
        if array.dtype.kind not in "OSU":
            raise _ResponseError(f"output `{name}` is BYTES: expected an object or bytes array, got {array.dtype}")
        return tuple(array.shape), memoryview(serialize_byte_tensor(array))
    want = _DTYPES[datatype]
    if array.dtype != want:
        raise _ResponseError(f"output `{name}` is {datatype} ({want}), the model gave {array.dtype}")
    return tuple(array.shape), memoryview(np.ascontiguousarray(array)).cast("B")


def _kiln_execute(model, requests, outputs):
    """Runs `model.execute(requests)` and checks its answer. Returns, per request,
    either a list of (shape, bytes) for `outputs` [(name, datatype)], or
    (error code, message) when that request alone failed. Raises for a failure of
    the whole batch (an exception of the model's, a wrong answer's shape)."""
    responses = model.execute(requests)
    if inspect.iscoroutine(responses):
        responses = _kiln_run(responses)
    if responses is None or not hasattr(responses, "__len__"):
        raise TritonModelException(
            f"execute() returned {type(responses).__name__}, not a list of {len(requests)} InferenceResponse"
        )
    if len(responses) != len(requests):
        raise TritonModelException(
            f"execute() returned {len(responses)} responses for {len(requests)} requests"
        )
    answers = []
    for response in responses:
        if not isinstance(response, InferenceResponse):
            raise TritonModelException(f"execute() returned a {type(response).__name__}, not an InferenceResponse")
        if response.has_error():
            error = response.error()
            if isinstance(error, TritonError):
                answers.append((error.code(), error.message()))
            else:
                answers.append((TritonError.INTERNAL, str(error)))
            continue
        try:
            answers.append([_kiln_output(response, name, datatype) for name, datatype in outputs])
        except _ResponseError as e:
            answers.append((TritonError.INTERNAL, str(e)))
    return answers
