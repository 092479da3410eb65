"""deploy/helm/colibri and deploy/kserve, without a cluster: the chart linted and rendered offline with
helm v4's own library (helm-python-sdk) for its default, GPU and CPU-only values and the other
settings it offers, and every rendered object validated against the schemas of Kubernetes 1.37
(kubernetes-validate, strict: unknown fields fail) or, for custom resources, of the CRDs in
tests/k8s_schemas (KServe, Prometheus Operator, KEDA). Then what the chart promises: the probes,
the watchdog off, non-root and read-only, one GPU per pod, the autoscaler's query."""
import copy
import gzip
import json
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
CHART = REPO_ROOT / "deploy" / "helm" / "colibri"
KSERVE = REPO_ROOT / "deploy" / "kserve"
SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas"
KUBERNETES_VERSION = "1.37.0"
NAMESPACE = "serving"


def _tool(module):
    """The tools come from the test profile (make test installs it): missing, the test fails
    saying so instead of skipping."""
    try:
        return __import__(module)
    except ImportError as error:
        pytest.fail(f"{module} is missing ({error}): install the test profile "
                    "(.venv/bin/pip install -c constraints.txt helm-python-sdk kubernetes-validate jsonschema)")


@pytest.fixture(scope="module")
def helm():
    return _tool("helm_python")


def values_file(name):
    return yaml.safe_load((CHART / name).read_text())


def merged(base, overrides):
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


FETCH_AND_PACK = {"weights": {"existingClaim": "", "fetch": {
    "enabled": True, "image": "python:3.12-slim",
    "command": ["sh", "-c", "export HOME=/tmp && pip install --target /tmp/hf huggingface_hub && "
                "PYTHONPATH=/tmp/hf python -m huggingface_hub.cli.hf download Qwen/Qwen1.5-MoE-A2.7B "
                "--include '*.json' --include '*.safetensors' --local-dir /staging"],
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]},
    "pack": {"enabled": True, "args": ["--layer", "1"]}}}
# Each set of values CI renders: the three values files and the choices they leave out.
VARIANTS = {
    "default": {},
    "gpu": values_file("values-gpu.yaml"),
    "cpu": values_file("values-cpu.yaml"),
    "gpu-prometheus-adapter": merged(values_file("values-gpu.yaml"), {"autoscaling": {"provider": "prometheus-adapter"}}),
    "fetch-and-pack": merged(values_file("values-gpu.yaml"), FETCH_AND_PACK),
    # a whole model: a folder of layer files on the claim, or fetched and packed with --layer all
    "whole-model": merged(values_file("values-gpu.yaml"), {"weights": {"folder": "qwen3-30b"}}),
    "whole-model-fetch-and-pack": merged(values_file("values-gpu.yaml"),
                                         merged(FETCH_AND_PACK, {"weights": {"folder": "qwen3-30b"}})),
}


def served_path(values):
    """What COLIBRI_WEIGHTS must name: the folder of a whole model, else the file."""
    weights = values.get("weights", {})
    return "/weights/" + (weights.get("folder") or weights.get("file") or "weights.colibri.safetensors")


def render(helm, values):
    chart = helm.Chart.load(str(CHART))
    manifests = chart.render(values, name="colibri", namespace=NAMESPACE)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".txt"):
            continue
        objects += [(path, doc) for doc in yaml.safe_load_all(text) if doc]
    return objects


def crd_schema(api_version, kind):
    if "/" not in api_version:  # the core group: Kubernetes' own
        return None
    group, version = api_version.split("/")
    path = SCHEMAS / f"{group}_{version}_{kind}.json.gz"
    if not path.exists():
        return None
    return strict(json.loads(gzip.decompress(path.read_bytes())))


def strict(schema):
    """An object schema that lists its properties refuses others (as kubeconform -strict, and the API
    server's strict field validation, do), unless it keeps unknown fields on purpose."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def validate(obj):
    """Validates one object; returns where its schema came from."""
    kubernetes_validate = _tool("kubernetes_validate")
    jsonschema = _tool("jsonschema")
    schema = crd_schema(obj["apiVersion"], obj["kind"])
    if schema is not None:
        jsonschema.validate(obj, schema, cls=jsonschema.Draft7Validator)
        return f"CRD {obj['apiVersion']}"
    try:
        return "Kubernetes " + kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"{obj['kind']} {obj['metadata'].get('name')}: {error.message} at {list(error.path)}")


def by_kind(objects, kind):
    found = [obj for _, obj in objects if obj["kind"] == kind]
    assert len(found) <= 1, f"{len(found)} {kind}s"
    return found[0] if found else None


@pytest.mark.parametrize("variant", VARIANTS)
def test_chart_lints_clean(helm, variant):
    report = helm.lint(str(CHART), VARIANTS[variant], strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBERNETES_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_validates(helm, variant):
    objects = render(helm, VARIANTS[variant])
    kinds = sorted(obj["kind"] for _, obj in objects)
    for path, obj in objects:
        assert obj["metadata"].get("name"), path
        validate(obj)
    expected = {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget"}
    if variant != "default" and variant != "cpu":
        expected |= {"ServiceMonitor", "ConfigMap"}
        expected.add("HorizontalPodAutoscaler" if "adapter" in variant else "ScaledObject")
    assert set(kinds) == expected, kinds


def test_kserve_runtime_and_inference_service_validate():
    objects = [obj for path in sorted(KSERVE.glob("*.yaml")) for obj in yaml.safe_load_all(path.read_text()) if obj]
    assert sorted(obj["kind"] for obj in objects) == ["InferenceService", "ServingRuntime"]
    for obj in objects:
        assert validate(obj).startswith("CRD serving.kserve.io/")
    runtime = next(obj for obj in objects if obj["kind"] == "ServingRuntime")
    service = next(obj for obj in objects if obj["kind"] == "InferenceService")
    assert service["spec"]["predictor"]["model"]["runtime"] == runtime["metadata"]["name"]
    assert service["spec"]["predictor"]["model"]["modelFormat"]["name"] in [
        f["name"] for f in runtime["spec"]["supportedModelFormats"]]
    container = runtime["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["COLIBRI_WATCHDOG"] == "0" and env["COLIBRI_WEIGHTS"].startswith("/mnt/models/")
    assert "--http-port=8080" in container["args"] and container["ports"][0]["containerPort"] == 8080
    assert container["livenessProbe"]["exec"]["command"][:4] == ["python3", "-m", "colibri", "probe"]


def triton_container(objects):
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    return pod, next(c for c in pod["containers"] if c["name"] == "triton")


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_watchdog_and_security(helm, variant):
    values = VARIANTS[variant]
    objects = render(helm, values)
    pod, triton = triton_container(objects)
    env = {e["name"]: e.get("value") for e in triton["env"]}
    assert env["COLIBRI_WATCHDOG"] == "0", "the kubelet restarts the container; the watchdog must be off"
    assert env["COLIBRI_WEIGHTS"] == served_path(values)
    ready = {"path": "/v2/models/colibri_moe/ready", "port": "http"}
    assert triton["startupProbe"]["httpGet"] == ready and triton["readinessProbe"]["httpGet"] == ready
    startup = triton["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "too short for a first load"
    live = triton["livenessProbe"]
    command = live["exec"]["command"]
    assert command[:4] == ["python3", "-m", "colibri", "probe"]
    assert command[command.index("--url") + 1] == "http://127.0.0.1:8000"
    assert float(command[command.index("--timeout") + 1]) < live["timeoutSeconds"]
    # Non-root, read-only, nothing to escalate; the writable places are volumes.
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"] + pod.get("initContainers", []):
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m for m in triton["volumeMounts"]}
    assert set(mounts) == {"/weights", "/dev/shm", "/var/cache/cupy", "/tmp"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert env["CUPY_CACHE_DIR"] == "/var/cache/cupy" and env["TMPDIR"] == "/tmp"


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpus_and_weights(helm, variant):
    values = VARIANTS[variant]
    objects = render(helm, values)
    pod, triton = triton_container(objects)
    env = {e["name"]: e.get("value") for e in triton["env"]}
    gpus = values.get("gpus", 1)
    limits = triton["resources"].get("limits", {})
    if gpus:
        assert limits["nvidia.com/gpu"] == gpus and "NVIDIA_VISIBLE_DEVICES" not in env
    else:
        assert "nvidia.com/gpu" not in limits and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    volumes = {v["name"]: v for v in pod["volumes"]}
    weights = values.get("weights", {})
    mount = next(m for m in triton["volumeMounts"] if m["name"] == "weights")
    if weights.get("demo"):
        assert env["COLIBRI_DEMO_IF_MISSING"] == "1" and "emptyDir" in volumes["weights"]
    else:
        assert "COLIBRI_DEMO_IF_MISSING" not in env, "a real deployment must never get random weights"
    if weights.get("fetch", {}).get("enabled"):
        inits = [c["name"] for c in pod["initContainers"]]
        assert inits == ["fetch-weights", "pack-weights"]
        pack = pod["initContainers"][1]
        assert pack["image"] == triton["image"] and "colibri pack" in pack["command"][2]
        assert pack["command"][3:] == ["/staging", "--layer", "1"]
        script = pack["command"][2]
        assert f"out={served_path(values)}\n" in script
        fetch = pod["initContainers"][0]
        assert fetch["command"][-1] == served_path(values), "fetch is skipped when what is served is there"
        if weights.get("folder"):  # every layer, into a folder written aside and renamed
            assert '"$@" --layer all' in script and 'rm -rf "$partial"' in script and 'mv "$partial" "$out"' in script
        else:
            assert "--layer all" not in script and "partial=/weights/.partial-$HOSTNAME.colibri.safetensors" in script
    elif not weights.get("demo"):
        assert volumes["weights"]["persistentVolumeClaim"] == {"claimName": "colibri-weights", "readOnly": True}
        assert mount["readOnly"] is True


def test_autoscaler_holds_queue_time_per_request(helm):
    objects = render(helm, VARIANTS["gpu"])
    assert "replicas" not in by_kind(objects, "Deployment")["spec"], "the autoscaler owns the replica count"
    scaled = by_kind(objects, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == by_kind(objects, "Deployment")["metadata"]["name"]
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    query = trigger["metadata"]["query"]
    selector = f'namespace="{NAMESPACE}",service="colibri",model="colibri_moe"'
    assert query == (f"(sum(rate(nv_inference_queue_duration_us{{{selector}}}[1m])) / "
                     f"(sum(rate(nv_inference_request_success{{{selector}}}[1m])) > 0)) or vector(0)")
    assert trigger["metadata"]["threshold"] == "10000"
    monitor = by_kind(objects, "ServiceMonitor")
    service = by_kind(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in [p["name"] for p in service["spec"]["ports"]]
    dashboard = json.loads(by_kind(objects, "ConfigMap")["data"]["colibri.json"])
    assert dashboard["uid"] == "colibri-moe"

    hpa = by_kind(render(helm, VARIANTS["gpu-prometheus-adapter"]), "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]
    rules = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "adapter-rules.yaml").read_text())
    names = [rule["name"]["as"] for rule in rules["rules"]["custom"]]
    assert metric["metric"]["name"] in names and metric["target"]["averageValue"] == "10000"


@pytest.mark.parametrize("overrides, message", [
    ({"weights": {"existingClaim": ""}}, "weights: no checkpoint source"),
    ({"weights": {"demo": True}}, "weights.demo writes random weights into an emptyDir"),
    ({"weights": {"fetch": {"enabled": True}}}, "weights.fetch.enabled needs weights.fetch.image"),
    ({"weights": {"pack": {"enabled": True}}}, "enable weights.fetch too"),
    ({"weights": {"file": "model.safetensors"}}, "/weights/file"),
    ({"weights": {"folder": "models/qwen"}}, "/weights/folder"),
    ({"weights": {"folder": ".."}}, "/weights/folder"),
    ({"weights": {"existingClaim": "", "demo": True, "folder": "qwen"}}, 'weights.folder ("qwen") is a whole model'),
    ({"gpus": -1}, "/gpus"),
    ({"autoscaling": {"enabled": True, "provider": "hpa"}}, "/autoscaling/provider"),
    ({"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 2}}, "autoscaling.minReplicas (4)"),
])
def test_contradictory_values_are_refused_with_the_reason(helm, overrides, message):
    with pytest.raises(helm.HelmError) as refused:
        render(helm, overrides)
    assert message in str(refused.value)


@pytest.mark.parametrize("kind, field", [
    ("Deployment", ("spec", "template", "spec", "containers", 0, "livenesProbe")),
    ("ScaledObject", ("spec", "triggers", 0, "metricTyp")),
    ("ServiceMonitor", ("spec", "endpoints", 0, "intervall")),
])
def test_validation_refuses_a_misspelt_field(helm, kind, field):
    """The checks above are not vacuous: one misspelt field fails them."""
    obj = copy.deepcopy(by_kind(render(helm, VARIANTS["gpu"]), kind))
    node = obj
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = node.get(field[-1][:-1], "x")
    with pytest.raises((pytest.fail.Exception, _tool("jsonschema").ValidationError)):
        validate(obj)
