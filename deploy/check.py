"""The checks of deploy/check (see there); run through it, with its venv."""

import glob
import gzip
import json
import os
import re
import sys

import jsonschema
import kubernetes_validate
import yaml

KUBERNETES = "1.34.0"


def documents(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def strict(schema):
    """`schema` with every object that lists its properties closed to others, as
    Kubernetes' strict field validation is (a misspelt field is an error)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_schemas(deploy):
    """(apiVersion, kind) -> the strict JSON schema of KServe's vendored CRDs."""
    schemas = {}
    for path in glob.glob(os.path.join(deploy, "kserve/crds/*.yaml.gz")):
        with gzip.open(path, "rt") as f:
            crd = yaml.safe_load(f)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            # metadata is Kubernetes' ObjectMeta, not described by the CRD.
            schema["properties"]["metadata"] = {"type": "object"}
            schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def flag(args, name):
    """The value of `--name=value` or `--name value` in `args`, else None."""
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
    return None


def check_probes(where, container, errors):
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container.get(probe)
        if spec is None:
            continue
        path = spec.get("httpGet", {}).get("path", "")
        if not path.startswith("/v2/health/"):
            errors.append(f"{where}: {probe} is not on /v2/health/* ({path!r})")
    if container.get("livenessProbe", {}).get("httpGet", {}).get("path") not in (
        None,
        "/v2/health/live",
    ):
        errors.append(f"{where}: livenessProbe must be /v2/health/live (it stays 200 while draining)")


def check_pod(where, pod, errors):
    """kiln's containers in a pod spec: ports the args name, probes, and a grace
    period long enough for preStop and the drain."""
    for c in pod.get("containers", []):
        if not c.get("image", "").startswith("kiln"):
            continue
        args = c.get("args", [])
        ports = {p["containerPort"] for p in c.get("ports", [])}
        for name in ("http-port", "grpc-port"):
            port = flag(args, name)
            if port is None or int(port) not in ports:
                errors.append(f"{where}: --{name} {port} is not a declared container port {sorted(ports)}")
        check_probes(where, c, errors)
        exit_timeout = int(flag(args, "exit-timeout-secs") or 30)
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if grace < pre_stop + exit_timeout:
            errors.append(
                f"{where}: terminationGracePeriodSeconds {grace} < preStop {pre_stop} + "
                f"--exit-timeout-secs {exit_timeout}: SIGKILL would cut the drain"
            )


def check_kubernetes(deploy, errors):
    for path in sorted(glob.glob(os.path.join(deploy, "kubernetes/*.yaml"))):
        for doc in documents(path):
            where = f"{os.path.relpath(path, deploy)}: {doc['kind']} {doc['metadata']['name']}"
            try:
                kubernetes_validate.validate(doc, KUBERNETES, strict=True)
            except Exception as e:  # the library's errors name the field
                errors.append(f"{where}: {e}")
                continue
            if doc["kind"] == "Deployment":
                check_pod(where, doc["spec"]["template"]["spec"], errors)
            print(f"ok  {where} (Kubernetes {KUBERNETES}, strict)")


def check_kserve(deploy, errors):
    schemas = crd_schemas(deploy)
    for path in sorted(glob.glob(os.path.join(deploy, "kserve/*.yaml"))):
        for doc in documents(path):
            where = f"{os.path.relpath(path, deploy)}: {doc['kind']} {doc['metadata']['name']}"
            schema = schemas.get((doc["apiVersion"], doc["kind"]))
            if schema is None:
                errors.append(f"{where}: no vendored CRD for {doc['apiVersion']} {doc['kind']}")
                continue
            problems = sorted(
                jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path)
            )
            for e in problems:
                errors.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
            if doc["kind"] == "ServingRuntime":
                spec = doc["spec"]
                container = spec["containers"][0]
                for arg in ("--model-store=/mnt/models", "--grpc-port=9000", "--http-port=8080"):
                    if arg not in container.get("args", []):
                        errors.append(f"{where}: lacks KServe's Triton argument {arg}")
                formats = {f["name"] for f in spec["supportedModelFormats"]}
                if not {"onnx", "triton"} <= formats:
                    errors.append(f"{where}: supports {sorted(formats)}, not onnx and triton")
                if sorted(spec.get("protocolVersions", [])) != ["grpc-v2", "v2"]:
                    errors.append(f"{where}: protocolVersions must be [v2, grpc-v2]")
                check_probes(where, container, errors)
            if not problems:
                print(f"ok  {where} (KServe CRD, strict)")


def container(deploy):
    """The Deployment's kiln container, for the image test."""
    for doc in documents(os.path.join(deploy, "kubernetes/deployment.yaml")):
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]["spec"]
            c = pod["containers"][0]
            return {
                "args": c["args"],
                "ports": {p["name"]: p["containerPort"] for p in c["ports"]},
                "probes": {
                    k: c[k]["httpGet"]["path"]
                    for k in ("startupProbe", "readinessProbe", "livenessProbe")
                },
                "readOnlyRootFilesystem": c["securityContext"]["readOnlyRootFilesystem"],
                "runAsUser": pod["securityContext"]["runAsUser"],
                "mounts": {m["mountPath"]: m.get("readOnly", False) for m in c["volumeMounts"]},
            }
    raise SystemExit("deploy/kubernetes/deployment.yaml holds no Deployment")


def main():
    deploy = sys.argv[1]
    if sys.argv[2:] == ["--container"]:
        json.dump(container(deploy), sys.stdout)
        return
    errors = []
    check_kubernetes(deploy, errors)
    check_kserve(deploy, errors)
    for e in errors:
        print(f"FAIL {e}", file=sys.stderr)
    if errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
