"""The Kubernetes manifests (deploy/kubernetes/), checked offline.

kustomize (``kubectl kustomize``, or a standalone ``kustomize``) renders the base, each gateway
overlay and the Prometheus Operator component. Every built-in object is validated with
kubernetes-validate's bundled schemas in strict mode (an unknown field is an error), and every
custom resource against the ``openAPIV3Schema`` of the CRD of the release it targets
(tests/deploy/crds/, SOURCES.md there), closed the way the API server's strict field validation
closes it. The negative cases prove that a wrong field fails. Then the wiring: the pool's picker
port reaches the shedder, the agents publish where the shedder listens, every setting is one the
programs accept, and the TLS proxy's Envoy config loads in the real Envoy. Last, the shedder and
an agent run as real processes on 127.0.0.1 with the rendered settings and CURVE keys.
"""

from __future__ import annotations

import copy
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from extproc.devstack import (
    ROOT,
    AgentProcess,
    Extproc,
    Proc,
    SimProcess,
    envoy_binary,
    free_port,
    metric_sums,
    wait_until,
)
from extproc.events.curve import check_publisher_dir, load_key_pair, load_public_key

KUBE = ROOT / "deploy" / "kubernetes"
CRDS = Path(__file__).resolve().parent / "crds"
NAMESPACE = "llm-shedder"
OVERLAYS = ("envoy-gateway", "istio")
# The oldest Kubernetes minor the manifests claim (docs/kubernetes.md) and the newest that
# kubernetes-validate ships schemas for.
KUBERNETES_VERSIONS = ("1.32", "1.37")
CLUSTER_SCOPED = {"Namespace", "GatewayClass"}
# The Secrets an operator creates (docs/kubernetes.md) and the files each holds.
USER_SECRETS = {
    "shedder-curve-extproc": ("extproc.key_secret",),
    "shedder-curve-publishers": ("worker.key",),
    "shedder-curve-worker": ("worker.key_secret", "extproc.key"),
    "shedder-epp-tls": ("tls.crt", "tls.key"),
}
OPTIONAL_SECRETS = {"shedder-admin-token", "hf-token"}

Doc = dict[str, Any]


# --------------------------------------------------------------------------- rendering


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.fixture(scope="module")
def kustomize() -> list[str]:
    command = _kustomize_command()
    if command is None:
        reason = (
            "neither kustomize nor kubectl is on PATH: the Kubernetes manifests are not rendered"
        )
        print(reason)
        pytest.skip(reason)
    return command


def _render(command: list[str], directory: Path) -> list[Doc]:
    proc = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(command)} {directory} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _with_component(tmp: Path, overlay: str) -> Path:
    """A kustomization that adds the Prometheus Operator component to an overlay."""
    tmp.mkdir(parents=True, exist_ok=True)
    rel = Path(os.path.relpath(KUBE, tmp))
    (tmp / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [str(rel / "overlays" / overlay)],
                "components": [str(rel / "components" / "prometheus-operator")],
            }
        )
    )
    return tmp


@pytest.fixture(scope="module")
def rendered(
    kustomize: list[str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[Doc]]:
    """name -> objects, for the base, each overlay and each overlay with the component."""
    out = {"base": _render(kustomize, KUBE / "base")}
    for overlay in OVERLAYS:
        out[overlay] = _render(kustomize, KUBE / "overlays" / overlay)
        tmp = tmp_path_factory.mktemp(f"{overlay}-prometheus-operator")
        out[f"{overlay}+prometheus-operator"] = _render(kustomize, _with_component(tmp, overlay))
    return out


def _find(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# --------------------------------------------------------------------------- schemas


def _closed(schema: Any) -> Any:
    """A CRD's structural schema as JSON Schema, closed the way strict field validation is:
    an object that lists its properties accepts no other key, int-or-string and nullable
    mean what the API server takes them to mean."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items() if k != "x-kubernetes-validations"}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    preserve = out.pop("x-kubernetes-preserve-unknown-fields", False)
    if out.get("type") == "object" and "properties" in out and not preserve:
        out.setdefault("additionalProperties", False)
    return out


@cache
def _kubernetes_definitions() -> dict[str, Any]:
    """Kubernetes' own type definitions (strict), for the metadata of custom resources."""
    version = kubernetes_validate.utils.latest_version()
    defs = kubernetes_validate.utils.schema_contents(
        f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version
    )
    definitions: dict[str, Any] = defs["$defs"]
    return definitions


OBJECT_META = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}


@cache
def _crd_schemas() -> dict[tuple[str, str], tuple[dict[str, Any], str]]:
    """(apiVersion, kind) -> (closed schema, CRD file name)."""
    out: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = _closed(version["schema"]["openAPIV3Schema"])
            # The API server adds these to every kind; some CRDs do not list them.
            schema["properties"].update(
                apiVersion={"type": "string"}, kind={"type": "string"}, metadata=OBJECT_META
            )
            schema["$defs"] = _kubernetes_definitions()
            schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind"})
            out[(f"{group}/{version['name']}", kind)] = (schema, path.name)
    return out


class InvalidManifest(AssertionError):
    """An object its schema refuses; the message names the object, the field and the rule."""


def _where(doc: Doc) -> str:
    return f"{doc.get('kind')} {doc.get('metadata', {}).get('name')!r} ({doc.get('apiVersion')})"


def validate(doc: Doc) -> None:
    """Validate one rendered object against its schema, or raise InvalidManifest."""
    crd = _crd_schemas().get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        schema, source = crd
        validator = jsonschema.Draft202012Validator(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
        if error is not None:
            path = ".".join(str(p) for p in error.absolute_path) or "(top)"
            raise InvalidManifest(f"{_where(doc)} against {source}: {path}: {error.message}")
        return
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path) or "(top)"
            raise InvalidManifest(
                f"{_where(doc)} against Kubernetes {version}: {path}: {exc.message}"
            ) from None
        except kubernetes_validate.SchemaNotFoundError:
            raise InvalidManifest(
                f"{_where(doc)}: no CRD under tests/deploy/crds and no Kubernetes {version} schema"
            ) from None


def test_every_crd_file_is_named_in_sources() -> None:
    sources = (CRDS / "SOURCES.md").read_text()
    files = sorted(p.name for p in CRDS.glob("*.yaml"))
    assert files
    for name in files:
        assert f"`{name}`" in sources, f"{name} has no source line in tests/deploy/crds/SOURCES.md"


def test_kubernetes_validate_ships_its_schemas() -> None:
    """Offline: the schemas are inside the package, nothing is downloaded."""
    for version in KUBERNETES_VERSIONS:
        assert f"{version}.0" in kubernetes_validate.utils.all_versions()


@pytest.mark.parametrize(
    "name", ["base", *OVERLAYS, *(f"{o}+prometheus-operator" for o in OVERLAYS)]
)
def test_every_object_validates(rendered: dict[str, list[Doc]], name: str) -> None:
    docs = rendered[name]
    assert docs
    for doc in docs:
        validate(doc)


def test_custom_resources_are_all_checked_against_a_crd(rendered: dict[str, list[Doc]]) -> None:
    kinds = {
        (d["apiVersion"], d["kind"])
        for docs in rendered.values()
        for d in docs
        if "." in d["apiVersion"].split("/")[0]
    }
    expected = {
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute"),
        ("gateway.networking.k8s.io/v1", "Gateway"),
        ("gateway.networking.k8s.io/v1", "GatewayClass"),
        ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"),
        ("networking.istio.io/v1", "DestinationRule"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
    }
    assert kinds - {("apps/v1", "Deployment")} == expected
    assert kinds <= set(_crd_schemas())


# --------------------------------------------------------------------------- negative cases


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    """A mutation that sets doc[a][b][0]... (numbers index lists) to value."""

    def apply(doc: Doc) -> None:
        keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
        node: Any = doc
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return apply


BAD = [
    # (overlay, kind, name, mutation, what the error must name)
    ("istio", "InferencePool", "vllm-pool", _set("spec.targetPort", 8000), "targetPort"),
    (
        "istio",
        "InferencePool",
        "vllm-pool",
        _set("spec.endpointPickerRef.failureMode", "FailOpn"),
        "FailOpn",
    ),
    ("istio", "InferencePool", "vllm-pool", _set("spec.targetPorts.0.number", 70000), "70000"),
    ("istio", "InferencePool", "vllm-pool", _set("metadata.label", {"a": "b"}), "label"),
    ("istio", "HTTPRoute", "llm-route", _set("spec.rules.0.timeouts.request", 300), "300"),
    (
        "istio",
        "HTTPRoute",
        "llm-route",
        _set("spec.rules.0.backendRefs.0.namespce", "x"),
        "namespce",
    ),
    ("istio", "Gateway", "inference-gateway", _set("spec.listeners.0.port", 0), "0"),
    (
        "istio",
        "DestinationRule",
        "shedder-epp",
        _set("spec.trafficPolicy.portLevelSettings.0.tls.mode", "DISABLED"),
        "DISABLED",
    ),
    (
        "envoy-gateway",
        "GatewayClass",
        "llm-shedder-envoy",
        _set("spec.controller", "x"),
        "controller",
    ),
    (
        "envoy-gateway",
        "ClientTrafficPolicy",
        "inference-gateway-buffer",
        _set("spec.connection.bufferLimit", "32 MiB"),
        "32 MiB",
    ),
    (
        "envoy-gateway+prometheus-operator",
        "PodMonitor",
        "shedder-epp",
        _set("spec.podMetricsEndpoints.0.intervall", "15s"),
        "intervall",
    ),
    (
        "istio",
        "Deployment",
        "vllm-worker",
        _set("spec.template.spec.containers.1.imagePullPolcy", "Always"),
        "imagePullPolcy",
    ),
    ("istio", "Deployment", "shedder-epp", _set("spec.replicas", "1"), "'1'"),
    ("istio", "Service", "shedder-epp", _set("spec.ports.0.port", "9002"), "'9002'"),
]


@pytest.mark.parametrize(
    ("overlay", "kind", "name", "mutate", "named"),
    BAD,
    ids=[f"{b[1]}-{b[4]}" for b in BAD],
)
def test_a_wrong_field_fails(
    rendered: dict[str, list[Doc]],
    overlay: str,
    kind: str,
    name: str,
    mutate: Callable[[Doc], None],
    named: str,
) -> None:
    doc = copy.deepcopy(_find(rendered[overlay], kind, name))
    validate(doc)  # as shipped: valid
    mutate(doc)
    with pytest.raises(InvalidManifest) as caught:
        validate(doc)
    assert named in str(caught.value)
    assert name in str(caught.value)


# --------------------------------------------------------------------------- wiring


def _pod_spec(deployment: Doc) -> Doc:
    spec: Doc = deployment["spec"]["template"]["spec"]
    return spec


def _container(deployment: Doc, name: str) -> Doc:
    return next(c for c in _pod_spec(deployment)["containers"] if c["name"] == name)


def _selects(selector: dict[str, str], deployment: Doc) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def _target(docs: list[Doc], service_name: str, port: int) -> tuple[Doc, Doc]:
    """(container, containerPort) a Service port leads to."""
    service = _find(docs, "Service", service_name)
    sport = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
    assert sport is not None, f"Service {service_name} has no port {port}"
    target = sport.get("targetPort", port)
    pods = [
        d for d in docs if d["kind"] == "Deployment" and _selects(service["spec"]["selector"], d)
    ]
    assert len(pods) == 1, f"Service {service_name} selects {len(pods)} Deployments"
    for container in _pod_spec(pods[0])["containers"]:
        for cport in container.get("ports", ()):
            if target in (cport.get("name"), cport["containerPort"]):
                return container, cport
    raise AssertionError(f"Service {service_name}:{port} -> {target!r}: no such container port")


def _expand(value: str, env: dict[str, str]) -> str:
    for key, val in env.items():
        value = value.replace(f"$({key})", val)
    return value


def _env(container: Doc, fields: dict[str, str]) -> dict[str, str]:
    """A container's environment as the kubelet would give it (field refs from ``fields``;
    optional secret refs left out)."""
    env: dict[str, str] = {}
    for item in container.get("env", ()):
        if "value" in item:
            env[item["name"]] = _expand(str(item["value"]), env)
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def check_wiring(docs: list[Doc]) -> None:
    """The references between objects hold; raises AssertionError naming the broken one."""
    pool = _find(docs, "InferencePool", "vllm-pool")
    picker = pool["spec"]["endpointPickerRef"]
    container, _ = _target(docs, picker["name"], picker["port"]["number"])
    assert container["name"] in ("extproc", "tls-proxy"), container["name"]
    workers = [
        d
        for d in docs
        if d["kind"] == "Deployment" and _selects(pool["spec"]["selector"]["matchLabels"], d)
    ]
    assert len(workers) == 1, f"the pool selects {len(workers)} Deployments"
    vllm = _container(workers[0], "vllm")
    served = {p["containerPort"] for p in vllm["ports"]}
    pool_ports = {p["number"] for p in pool["spec"]["targetPorts"]}
    assert pool_ports <= served, f"pool ports {pool_ports} not served by vLLM ({served})"

    route = _find(docs, "HTTPRoute", "llm-route")
    for parent in route["spec"]["parentRefs"]:
        _find(docs, parent["kind"], parent["name"])
    for rule in route["spec"]["rules"]:
        for ref in rule["backendRefs"]:
            assert _find(docs, ref["kind"], ref["name"]) is pool

    # The agent publishes to the Service port that leads to the shedder's event socket, and
    # announces the pod IP on a pool port.
    agent = _container(workers[0], "agent")
    fields = {"metadata.name": "vllm-worker-abc12", "status.podIP": "10.0.0.7"}
    args = [_expand(a, _env(agent, fields)) for a in agent["args"]]
    publish = next(a.split("=", 1)[1] for a in args if a.startswith("--publish="))
    host, port = publish.removeprefix("tcp://").rsplit(":", 1)
    container, cport = _target(docs, host, int(port))
    assert container["name"] == "extproc"
    bind = _env(container, {})["EXTPROC_EVENT_BIND"]
    assert bind.endswith(f":{cport['containerPort']}"), (bind, cport)
    endpoint = next(a.split("=", 1)[1] for a in args if a.startswith("--endpoint="))
    assert endpoint == "10.0.0.7:" + str(min(pool_ports)), endpoint

    # Every Secret and ConfigMap a pod mounts is rendered here or created by the operator.
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        for volume in _pod_spec(deployment).get("volumes", ()):
            if "secret" in volume:
                secret = volume["secret"]["secretName"]
                assert secret in USER_SECRETS or ("Secret", secret) in names, secret
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names, volume


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_wiring_holds(rendered: dict[str, list[Doc]], overlay: str) -> None:
    check_wiring(rendered[overlay])


@pytest.mark.parametrize(
    "mutate",
    [
        _set("spec.endpointPickerRef.port.number", 9005),
        _set("spec.selector.matchLabels", {"app.kubernetes.io/name": "vllm"}),
        _set("spec.targetPorts", [{"number": 8001}]),
    ],
    ids=["picker-port", "selector", "target-port"],
)
def test_a_broken_reference_is_caught(
    rendered: dict[str, list[Doc]], mutate: Callable[[Doc], None]
) -> None:
    docs = copy.deepcopy(rendered["istio"])
    check_wiring(docs)
    mutate(_find(docs, "InferencePool", "vllm-pool"))
    with pytest.raises(AssertionError):
        check_wiring(docs)


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_namespaces(rendered: dict[str, list[Doc]], name: str) -> None:
    for doc in rendered[name]:
        namespace = doc["metadata"].get("namespace")
        if doc["kind"] in CLUSTER_SCOPED:
            assert namespace is None, f"{_where(doc)} is cluster-scoped"
        else:
            assert namespace == NAMESPACE, _where(doc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_run_unprivileged_with_resources(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    for deployment in (d for d in rendered[overlay] if d["kind"] == "Deployment"):
        pod = _pod_spec(deployment)
        for container in pod["containers"]:
            where = f"{deployment['metadata']['name']}/{container['name']}"
            context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
            assert context.get("runAsNonRoot") is True, where
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where
            assert "memory" in container["resources"]["limits"], where
            if container.get("ports"):
                assert container.get("readinessProbe"), where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_images_are_pinned(rendered: dict[str, list[Doc]], overlay: str) -> None:
    for deployment in (d for d in rendered[overlay] if d["kind"] == "Deployment"):
        for container in _pod_spec(deployment)["containers"]:
            image = container["image"]
            assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), image


# --------------------------------------------------------------------------- the programs


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The CURVE Secrets as docs/kubernetes.md makes them, one directory per Secret."""
    keys = tmp_path_factory.mktemp("keys")
    for name in ("extproc", "worker"):
        subprocess.run(
            [sys.executable, "-m", "extproc.events.keys", str(keys), name],
            check=True,
            capture_output=True,
            timeout=60,
        )
    out: dict[str, Path] = {}
    for secret, files in USER_SECRETS.items():
        if secret == "shedder-epp-tls":
            continue
        folder = tmp_path_factory.mktemp(secret)
        for file in files:
            shutil.copy(keys / file, folder / file)
        out[secret] = folder
    return out


def _mounts(deployment: Doc, container: Doc, secrets: dict[str, Path]) -> dict[str, Path]:
    """mount path -> the local directory standing for the Secret mounted there."""
    volumes = {v["name"]: v for v in _pod_spec(deployment)["volumes"]}
    out = {}
    for mount in container.get("volumeMounts", ()):
        secret = volumes[mount["name"]].get("secret", {}).get("secretName")
        if secret in secrets:
            out[mount["mountPath"]] = secrets[secret]
    return out


def _local(value: str, mounts: dict[str, Path]) -> str:
    for path, folder in mounts.items():
        value = value.replace(path, str(folder))
    return value


def test_the_docs_create_every_secret() -> None:
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    for secret, files in USER_SECRETS.items():
        assert secret in docs, secret
        for file in files:
            assert file in docs, (secret, file)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_extproc_accepts_its_settings(
    rendered: dict[str, list[Doc]], overlay: str, secrets: dict[str, Path]
) -> None:
    from extproc.settings import TABLE, load_settings

    deployment = _find(rendered[overlay], "Deployment", "shedder-epp")
    container = _container(deployment, "extproc")
    assert container["command"] == ["python", "-m", "extproc"]
    mounts = _mounts(deployment, container, secrets)
    env = {k: _local(v, mounts) for k, v in _env(container, {}).items()}
    known = {row["env"] for row in TABLE.values()} | {"DYN_HTTP_OVERLOAD_STATUS_CODE"}
    unknown = set(env) - known
    assert not unknown, f"settings the extproc does not read: {sorted(unknown)}"
    settings = load_settings([], env)
    assert settings.model_dump()["protocol"] == "epp"
    load_key_pair(env["EXTPROC_EVENT_CURVE_SECRET_KEY"])
    check_publisher_dir(env["EXTPROC_EVENT_CURVE_PUBLISHERS"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_agent_accepts_its_command_line(
    rendered: dict[str, list[Doc]], overlay: str, secrets: dict[str, Path]
) -> None:
    from llmworker.agent import parse_args

    deployment = _find(rendered[overlay], "Deployment", "vllm-worker")
    container = _container(deployment, "agent")
    assert container["command"] == ["python", "-m", "llmworker.agent"]
    fields = {"metadata.name": "vllm-worker-abc12", "status.podIP": "10.0.0.7"}
    env = _env(container, fields)
    mounts = _mounts(deployment, container, secrets)
    argv = [_local(_expand(a, env), mounts) for a in container["args"]]
    settings, warning = parse_args(argv, {})
    assert warning is None
    assert settings.engine == "vllm"
    assert settings.worker_id == "vllm-worker-abc12"
    assert settings.endpoint == "10.0.0.7:8000"
    assert settings.model == env["MODEL"] == _env(_container(deployment, "vllm"), {})["MODEL"]
    assert settings.curve is not None
    extproc_public = load_public_key(secrets["shedder-curve-extproc"] / "extproc.key_secret")
    assert settings.curve.server_public == extproc_public


def test_the_tls_proxy_config_loads_in_envoy(
    rendered: dict[str, list[Doc]], tmp_path: Path
) -> None:
    """The Envoy Gateway overlay's TLS proxy, with a self-signed certificate as the docs make it."""
    if shutil.which("openssl") is None:
        reason = "openssl is not on PATH: the TLS proxy's certificate cannot be made"
        print(reason)
        pytest.skip(reason)
    docs = rendered["envoy-gateway"]
    deployment = _find(docs, "Deployment", "shedder-epp")
    proxy = _container(deployment, "tls-proxy")
    volumes = {v["name"]: v for v in _pod_spec(deployment)["volumes"]}
    cert_dir = next(
        m["mountPath"]
        for m in proxy["volumeMounts"]
        if volumes[m["name"]].get("secret", {}).get("secretName") == "shedder-epp-tls"
    )
    config_map = next(
        volumes[m["name"]]["configMap"]["name"]
        for m in proxy["volumeMounts"]
        if "configMap" in volumes[m["name"]]
    )
    config = _find(docs, "ConfigMap", config_map)["data"]["envoy.yaml"]
    subprocess.run(
        shlex.split(
            f"openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj /CN=shedder-epp"
            f" -keyout {tmp_path / 'tls.key'} -out {tmp_path / 'tls.crt'}"
        ),
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert f"{cert_dir}/tls.crt" in config
    path = tmp_path / "envoy.yaml"
    path.write_text(config.replace(cert_dir, str(tmp_path)))
    proc = subprocess.run(
        [
            envoy_binary(),
            "--mode",
            "validate",
            "-c",
            str(path),
            "--disable-hot-restart",
            "-l",
            "error",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The proxy forwards to the port the shedder listens on, on loopback only.
    env = _env(_container(deployment, "extproc"), {})
    assert env["EXTPROC_GRPC_HOST"] == "127.0.0.1"
    assert f"port_value: {env['EXTPROC_GRPC_PORT']}" in config


# --------------------------------------------------------------------------- the pods, run


def _rebind(argv: list[str], flag: str, old: str, new: str) -> list[str]:
    """argv with ``--flag=old`` replaced by ``--flag=new`` (which must be there)."""
    assert f"{flag}={old}" in argv, (flag, old, argv)
    return [f"{flag}={new}" if a == f"{flag}={old}" else a for a in argv]


def test_the_pods_programs_run_as_rendered(
    rendered: dict[str, list[Doc]], secrets: dict[str, Path], tmp_path: Path
) -> None:
    """The shedder and an agent, started with the rendered environment and command line
    and the CURVE keys laid out as the Secrets mount them, on 127.0.0.1 (listen addresses and
    ports moved there); a simulated engine stands in for vLLM. The agent's worker is known
    under the pod's name and IP; a publisher without the workers' key is refused."""
    docs = rendered["istio"]
    epp = _find(docs, "Deployment", "shedder-epp")
    extproc = _container(epp, "extproc")
    env = {k: _local(v, _mounts(epp, extproc, secrets)) for k, v in _env(extproc, {}).items()}
    grpc, admin, events, engine = free_port(), free_port(), free_port(), free_port()
    assert env["EXTPROC_EVENT_BIND"] == "tcp://0.0.0.0:5557"
    env |= {
        "EXTPROC_GRPC_HOST": "127.0.0.1",
        "EXTPROC_GRPC_PORT": str(grpc),
        "EXTPROC_ADMIN_HOST": "127.0.0.1",
        "EXTPROC_ADMIN_PORT": str(admin),
        "EXTPROC_EVENT_BIND": f"tcp://127.0.0.1:{events}",
    }
    workers = _find(docs, "Deployment", "vllm-worker")
    agent = _container(workers, "agent")
    fields = {"metadata.name": "vllm-worker-abc12", "status.podIP": "127.0.0.1"}
    agent_env = _env(agent, fields)
    argv = [_local(_expand(a, agent_env), _mounts(workers, agent, secrets)) for a in agent["args"]]
    argv = _rebind(argv, "--engine-url", "http://127.0.0.1:8000", f"http://127.0.0.1:{engine}")
    argv = _rebind(argv, "--publish", "tcp://shedder-epp:5557", f"tcp://127.0.0.1:{events}")
    model = agent_env["MODEL"]

    started: list[Proc] = []
    shedder = Extproc(tmp_path, env=env, ports=(grpc, admin, events), ready_timeout=30)
    try:
        started.append(
            SimProcess(
                ["--port", str(engine), "--model", model, "--worker-id", "engine",
                 "--kv-total-blocks", "256", "--speedup", "20"],
                log_dir=tmp_path,
            )
        )  # fmt: skip
        started.append(AgentProcess([*argv, "--interval", "0.05"], log_dir=tmp_path))

        def known() -> dict[str, Any] | None:
            for proc in started:
                proc.check_alive()
            return shedder.workers().get("vllm-worker-abc12")

        worker = wait_until(known, 30, "the agent's worker known to the shedder")
        assert worker["endpoint"] == "127.0.0.1:8000"
        assert worker["model"] == model

        def refused() -> float:
            return metric_sums(shedder.metrics()).get("extproc_events_refused_total", 0.0)

        # (An admitted agent's first connection may count one refusal: it reconnects at once.)
        before = refused()

        # The same agent without the workers' key pair: its handshake fails, nothing it
        # says is heard.
        plain = [a for a in argv if not a.startswith("--curve-")]
        plain = _rebind(plain, "--worker-id", "vllm-worker-abc12", "intruder")
        started.append(
            AgentProcess([*plain, "--interval", "0.05"], log_dir=tmp_path, name="intruder")
        )
        # Refused, and refused again when it tries again: nothing it sent got through.
        wait_until(lambda: refused() >= before + 2, 30, "the keyless publisher refused twice")
        started[-1].check_alive()
        assert "intruder" not in shedder.workers()
    finally:
        for proc in reversed(started):
            proc.stop()
        shedder.stop()
