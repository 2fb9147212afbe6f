"""Renders the Helm chart helm/duet offline and validates what it renders, for any
test suite (`from helm_chart import render`: pytest puts tests/ on sys.path through
tests/conftest.py, as tests/integration/ for `duet_cluster`).

Rendering is Helm v4's own engine through helm-python-sdk (no helm binary, no
cluster). `Chart.render` validates the values against the chart's
values.schema.json itself (a violation raises `HelmValuesError` naming the value),
so no separate jsonschema pass is needed before it. Templates that `fail` raise
`HelmRenderError` with their message.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import yaml

from cluster.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "duet"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
DATA = Path(__file__).resolve().parent / "data"
RAYSERVICE_CRD = DATA / "kuberay" / "ray.io_rayservices.yaml"
MONITOR_CRDS = {
    "PodMonitor": DATA / "prometheus-operator" / "monitoring.coreos.com_podmonitors.yaml",
    "ServiceMonitor": DATA / "prometheus-operator" / "monitoring.coreos.com_servicemonitors.yaml",
}
# A Kubernetes release kubernetes-validate ships schemas for.
KUBE_VERSION = "1.33.0"
RELEASE = "duet"  # the examples' Redis URLs name it

Values = dict[str, Any]


def load_values(path: str | Path) -> Values:
    return yaml.safe_load(Path(path).read_text()) or {}


@functools.cache
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def _values(values: Values | str | Path | None) -> Values:
    return load_values(values) if isinstance(values, (str, Path)) else dict(values or {})


def merged_values(values: Values | str | Path | None = None) -> Values:
    """What the templates see: the chart's defaults coalesced with `values`."""
    return chart().merge_values(_values(values))


def cluster_config(values: Values | str | Path | None = None) -> ClusterConfig:
    """The ClusterConfig of a release: its merged `duet:` section."""
    return ClusterConfig.model_validate(merged_values(values)["duet"])


def render_manifests(values: Values | str | Path | None = None, release: str = RELEASE,
                     namespace: str = "default") -> dict[str, str]:
    """{template path: rendered text}, NOTES.txt included."""
    return chart().render(_values(values), name=release, namespace=namespace)


def render(values: Values | str | Path | None = None, release: str = RELEASE,
           namespace: str = "default") -> list[dict]:
    """The Kubernetes objects of a release, parsed (empty documents dropped)."""
    objects: list[dict] = []
    for path, text in sorted(render_manifests(values, release, namespace).items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def find(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def rayservice(objects: list[dict]) -> dict:
    (obj,) = find(objects, "RayService")
    return obj


def serve_config_v2(objects: list[dict]) -> dict:
    """The Serve config (ServeDeploySchema) the RayService carries, parsed."""
    return yaml.safe_load(rayservice(objects)["spec"]["serveConfigV2"])


def carried_configs(serve_config: dict) -> tuple[dict, list[ClusterConfig]]:
    """A Serve config without the cluster configs it carries (the app's `args` and the
    goodput policy's kwargs), and those configs validated. The chart carries the
    user's YAML, duet's generator only what differs from the defaults: compare the
    configs as configs, and the rest exactly."""
    sc = copy.deepcopy(serve_config)
    app = sc["applications"][0]
    configs = [app["args"].pop("config")]
    if "autoscaling_policy" in app:
        configs.append(app["autoscaling_policy"]["policy_kwargs"].pop("config"))
    # Fixed pools' sizes travel in `deployments` (kept in the rest, compared exactly).
    sizes = {d["name"]: d["num_replicas"] for d in app.get("deployments", [])}
    found = []
    for config in configs:
        config = copy.deepcopy(config)
        for name, n in sizes.items():
            pool = config.setdefault(name, {})
            assert "replicas" not in pool, f"{name}.replicas is in the carried config: a resize would restart all"
            pool["replicas"] = n
        found.append(ClusterConfig.model_validate(config))
    return sc, found


def same_serve_config(a: dict, b: dict) -> bool:
    """`a` and `b` deploy the same app with the same cluster config."""
    return carried_configs(a) == carried_configs(b)


def ray_pod_groups(objects: list[dict]) -> dict[str, dict]:
    """{"head": headGroupSpec, <worker group>: its spec} of the RayService."""
    cluster = rayservice(objects)["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])}}


def ray_start_resources(group: dict) -> dict[str, float]:
    """A group's rayStartParams `resources`, read as KubeRay does (outer quotes off)."""
    text = group["rayStartParams"].get("resources")
    return json.loads(text.strip("'\"` ")) if text else {}


def namespace_nodes(objects: list[dict]) -> tuple:
    """One namespace-cluster node (cluster/netns.py) per Ray pod group of the rendered
    RayService, started with that group's own rayStartParams, shell quotes off as the
    pod's shell takes them off. The duet node groups a node offers are its `duet/*`
    resources."""
    import shlex

    from cluster.netns import NodeSpec

    nodes = []
    for name, group in ray_pod_groups(objects).items():
        params = tuple((k, " ".join(shlex.split(str(v)))) for k, v in group["rayStartParams"].items())
        groups = tuple(r.removeprefix("duet/") for r in ray_start_resources(group) if r.startswith("duet/"))
        nodes.append(NodeSpec(name, groups, head=name == "head", ray_start_params=params))
    return tuple(nodes)


def _closed(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected. The API server drops them
    (pruning) or refuses them (kubectl's strict field validation); either way a
    field the CRD does not know is a chart bug, which plain jsonschema would allow."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: _closed(s) for name, s in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    # allOf/anyOf/oneOf branches are left open: a branch lists only some fields.
    return out


@functools.cache
def crd_schema(path: Path, version: str = "v1") -> dict:
    """`spec.versions[?name=version].schema.openAPIV3Schema` of a CRD file, closed."""
    crd = yaml.safe_load(path.read_text())
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _closed(v["schema"]["openAPIV3Schema"])


def validate_object(obj: dict) -> str:
    """Validates one rendered object against its schema; returns what it used.
    Core kinds: Kubernetes' OpenAPI schemas (kubernetes-validate, strict: unknown
    fields fail). RayService: KubeRay's CRD; monitors: the Prometheus Operator's."""
    kind = obj["kind"]
    if kind == "RayService":
        jsonschema.validate(obj, crd_schema(RAYSERVICE_CRD), cls=jsonschema.Draft7Validator)
        return "kuberay-crd"
    if kind in MONITOR_CRDS:
        jsonschema.validate(obj, crd_schema(MONITOR_CRDS[kind]), cls=jsonschema.Draft7Validator)
        return "prometheus-operator-crd"
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    return f"kubernetes-{KUBE_VERSION}"
