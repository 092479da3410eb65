"""The Grafana dashboard (deploy/helm/colibri/dashboards/colibri.json) and the autoscaler's queries:
the dashboard is a well-formed Grafana dashboard model, and every metric its queries name is one a
served colibri_moe exposes (scraped from a real tritonserver here) or, for GPU metrics a CPU host
does not expose, one Triton's metrics documentation lists."""
import json
import re
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = REPO_ROOT / "deploy" / "helm" / "colibri" / "dashboards" / "colibri.json"
ADAPTER_RULES = REPO_ROOT / "deploy" / "prometheus" / "adapter-rules.yaml"
HELPERS = REPO_ROOT / "deploy" / "helm" / "colibri" / "templates" / "_helpers.tpl"

# Triton's "GPU Metrics" table (docs/user_guide/metrics.md, triton-inference-server/server): DCGM
# reports them only where a GPU is, so the CPU server of this test cannot show them.
TRITON_GPU_METRICS = {"nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption",
                      "nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes"}
PROMQL_FUNCTIONS = {"sum", "avg", "max", "min", "count", "rate", "irate", "increase", "histogram_quantile",
                    "vector", "clamp_min", "clamp_max", "label_values"}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset"}
PANEL_KINDS = {"timeseries", "stat", "gauge", "bargauge", "heatmap", "table", "row"}


def metric_names(expr):
    """The metric names a PromQL expression reads; fails on a function it does not know."""
    text = re.sub(r'"[^"]*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)        # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)       # ranges, $__rate_interval included
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)\s*(\()?", text):
        word, call = match.groups()
        if word in PROMQL_WORDS:
            continue
        if call:
            assert word in PROMQL_FUNCTIONS, f"unexpected function {word}() in {expr}"
        else:
            names.add(word)
    return names


def exposed(text):
    """Metric names in a Prometheus exposition; a histogram's series too."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def dashboard():
    return json.loads(DASHBOARD.read_text())


def panel_queries(model):
    return [(panel["title"], target["expr"]) for panel in model["panels"] for target in panel.get("targets", [])]


def test_dashboard_is_a_grafana_dashboard_model():
    model = dashboard()
    for key, kind in [("uid", str), ("title", str), ("schemaVersion", int), ("panels", list),
                      ("templating", dict), ("time", dict)]:
        assert isinstance(model.get(key), kind), f"{key}: {model.get(key)!r}"
    ids = [panel["id"] for panel in model["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"] for v in model["templating"]["list"]}
    assert variables == {"datasource", "namespace", "model"}
    for panel in model["panels"]:
        assert panel["type"] in PANEL_KINDS, panel["type"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, f"{panel['title']}: undefined {used - variables}"


def test_dashboard_shows_what_the_issue_asks_for():
    names = set().union(*(metric_names(expr) for _, expr in panel_queries(dashboard())))
    for name in ["colibri_expert_tokens_total", "colibri_forward_seconds_bucket", "nv_inference_queue_duration_us",
                 "nv_inference_compute_infer_duration_us", "nv_inference_request_success", "nv_gpu_memory_used_bytes"]:
        assert name in names, name


def test_metric_name_parser():
    assert metric_names('sum by (le) (rate(a_b{x="y",z=~"$v"}[$__rate_interval])) / 1e3 or vector(0)') == {"a_b"}
    with pytest.raises(AssertionError, match="unexpected function"):
        metric_names("predict_linear(a[5m], 60)")


def queries_besides_the_dashboard():
    """The KEDA query (the chart's helper) and prometheus-adapter's rule, with templating removed."""
    helper = HELPERS.read_text()
    keda = re.search(r'define "colibri.queueQuery".*?\n(\(sum.*?)\n\{\{- end', helper, re.S).group(1)
    keda = re.sub(r"\{\{.*?\}\}", "", keda)
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]["custom"]
    adapter = [re.sub(r"<<\.\w+>>", "", rule["metricsQuery"]) for rule in rules]
    return [("KEDA query", keda)] + [("prometheus-adapter rule", q) for q in adapter]


def test_every_query_names_a_metric_colibri_or_triton_exposes(colibri_server):
    # One request first, so that every family the model registers has a sample.
    from colibri.serving import watchdog
    watchdog.probe(f"http://{colibri_server.http_url}")
    text = colibri_server.get(colibri_server.metrics_url)
    names = exposed(text)
    assert {"colibri_expert_tokens_total", "colibri_forward_seconds_bucket", "nv_inference_queue_duration_us"} <= names
    known = names | TRITON_GPU_METRICS
    missing = [(where, name) for where, expr in panel_queries(dashboard()) + queries_besides_the_dashboard()
               for name in sorted(metric_names(expr)) if name not in known]
    assert not missing, f"not in the server's exposition nor Triton's GPU metrics: {missing}"


def test_compose_scrape_example_labels_series_as_kubernetes_does():
    config = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "prometheus-compose.yml").read_text())
    static = config["scrape_configs"][0]["static_configs"][0]
    compose = (REPO_ROOT / "docker" / "docker-compose.yml").read_text()
    port = re.search(r"\$\{COLIBRI_METRICS_PORT:-(\d+)\}:8002", compose).group(1)
    assert static["targets"] == [f"127.0.0.1:{port}"]
    # the labels the dashboard's variables and the autoscaler's query select on
    assert {"namespace", "service", "pod"} <= set(static["labels"])
