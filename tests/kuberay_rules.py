"""What KubeRay's operator refuses in a RayService beyond its CRD's schema.

The operator runs Go checks before it reconciles (ray-operator/controllers/ray/utils/
validation.go: `ValidateRayServiceMetadata`, `ValidateRayServiceSpec`, which calls
`ValidateRayClusterSpec`; name limits from utils/constant.go). A RayService that
passes the CRD's schema but fails one of them is accepted by the API server and then
never becomes a cluster: the operator only records an event. These are those rules,
restated over the rendered object (a dict), so the chart tests catch what only a real
operator would. Read from KubeRay's main branch late in 2026 (commit 0074504f), a
little newer than the v1.7.0 CRD in tests/data/kuberay/: a rule added since v1.7.0
refuses more, never less. Rules that concern RayJob or features the chart never
renders are left out; `unchecked` names them.
"""

from __future__ import annotations

import re
from typing import Any

# utils/constant.go: a cluster's longest Service suffix is "-serve-svc" (63 - 10), and
# the operator appends 6 characters to a RayService's name to name its cluster.
MAX_RAYCLUSTER_NAME = 53
MAX_RAYSERVICE_NAME = MAX_RAYCLUSTER_NAME - 6
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
LABEL_NAME = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
INITIALIZING_TIMEOUT = "ray.io/initializing-timeout"
FT_ANNOTATION = "ray.io/ft-enabled"
EXTERNAL_STORAGE_NS = "ray.io/external-storage-namespace"
UPGRADE_TYPES = {"None", "NewCluster", "NewClusterWithIncrementalUpgrade"}
RAY_START_RESOURCE_KEYS = ("num-cpus", "num-gpus", "memory", "resources")

unchecked = (
    "RayJob and RayCronJob rules (the chart renders neither)",
    "feature gates of the running operator (RayJobDeletionPolicy): a suspended worker group is refused as if off",
)


def _env(container: dict, name: str) -> dict | None:
    return next((e for e in container.get("env", []) if e.get("name") == name), None)


def _label_errors(group: str, labels: dict[str, str]) -> list[str]:
    """k8s.io/apimachinery's IsQualifiedName (key) and IsValidLabelValue (value)."""
    errors = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (not name or len(name) > 63 or not LABEL_NAME.fullmatch(name)
                or (prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.fullmatch(prefix)))):
            errors.append(f"invalid label key for {group} group: {key!r}")
        if len(value) > 63 or not LABEL_NAME.fullmatch(value):
            errors.append(f"invalid label value for key {key!r} in {group} group: {value!r}")
    return errors


def _group_errors(group: str, spec: dict) -> list[str]:
    errors = []
    if not spec.get("template", {}).get("spec", {}).get("containers"):
        errors.append(f"{group} group should have at least one container")
    params = spec.get("rayStartParams", {})
    if any(params.get(k) for k in RAY_START_RESOURCE_KEYS) and spec.get("resources"):
        errors.append(f"resource fields set in both rayStartParams and Resources for {group} group")
    if "labels" in params:
        errors.append(f"rayStartParams['labels'] is not supported for {group} group")
    errors += _label_errors(group, spec.get("labels", {}))
    return errors


def _autoscaling(cluster: dict) -> bool:
    return bool(cluster.get("enableInTreeAutoscaling"))


def _autoscaler_v2(cluster: dict, head: dict) -> bool:
    version = (cluster.get("autoscalerOptions") or {}).get("version")
    env = _env(head, "RAY_enable_autoscaler_v2")
    return version == "v2" or (env is not None and env.get("value") in ("1", "true"))


def _duration_ok(text: str) -> bool:
    if re.fullmatch(r"\d+", text):
        return int(text) > 0
    parts = re.fullmatch(r"((\d+(\.\d+)?)(ns|us|µs|ms|s|m|h))+", text)
    return bool(parts) and any(float(n) > 0 for n in re.findall(r"(\d+(?:\.\d+)?)", text))


def cluster_spec_errors(cluster: dict, annotations: dict[str, str]) -> list[str]:
    """`ValidateRayClusterSpec`."""
    head_group = cluster.get("headGroupSpec", {})
    errors = _group_errors("Head", head_group)
    workers = cluster.get("workerGroupSpecs", [])
    for w in workers:
        errors += _group_errors(w.get("groupName", "?"), w)
    containers = head_group.get("template", {}).get("spec", {}).get("containers") or [{}]
    head = containers[0]
    ft = cluster.get("gcsFaultToleranceOptions")
    if annotations.get(FT_ANNOTATION) and ft is not None:
        errors.append(f"{FT_ANNOTATION} annotation and gcsFaultToleranceOptions are both set")
    ft_on = ft is not None or annotations.get(FT_ANNOTATION) == "true"
    if not ft_on and _env(head, "RAY_REDIS_ADDRESS"):
        errors.append("RAY_REDIS_ADDRESS is set without gcsFaultToleranceOptions")
    if ft is not None:
        if head_group.get("rayStartParams", {}).get("redis-password"):
            errors.append("redis-password in rayStartParams with gcsFaultToleranceOptions")
        for name in ("REDIS_PASSWORD", "RAY_REDIS_ADDRESS"):
            if _env(head, name):
                errors.append(f"{name} env in the head pod with gcsFaultToleranceOptions")
        if annotations.get(EXTERNAL_STORAGE_NS):
            errors.append(f"{EXTERNAL_STORAGE_NS} annotation with gcsFaultToleranceOptions")
    if head_group.get("rayStartParams", {}).get("redis-username") or _env(head, "REDIS_USERNAME"):
        errors.append("a redis username in rayStartParams or the head's env")
    for w in workers:
        if w.get("suspend"):
            errors.append(f"worker group {w.get('groupName')} is suspended")
    if not _autoscaling(cluster):
        env = _env(head, "RAY_enable_autoscaler_v2")
        if env is not None and env.get("value") in ("1", "true"):
            errors.append("RAY_enable_autoscaler_v2 is on while enableInTreeAutoscaling is false")
    else:
        if (cluster.get("autoscalerOptions") or {}).get("version") and _env(head, "RAY_enable_autoscaler_v2"):
            errors.append("both autoscalerOptions.version and RAY_enable_autoscaler_v2 are set")
        if _autoscaler_v2(cluster, head):
            for name, spec in [("head", head_group), *((w.get("groupName"), w) for w in workers)]:
                policy = spec.get("template", {}).get("spec", {}).get("restartPolicy", "")
                if policy not in ("", "Never"):
                    errors.append(f"restartPolicy of {name} must be Never or unset with autoscaler v2")
    if (cluster.get("authOptions") or {}).get("mode") == "token":
        version = cluster.get("rayVersion", "")
        nums = [int(x) for x in re.findall(r"\d+", version)[:3]]
        if not nums or tuple(nums) < (2, 52, 0):
            errors.append(f"authOptions.mode token needs rayVersion >= 2.52.0, got {version!r}")
    return errors


def rayservice_errors(rs: dict[str, Any]) -> list[str]:
    """`ValidateRayServiceMetadata` and `ValidateRayServiceSpec`: what the operator
    would refuse in this RayService (empty: nothing)."""
    meta, spec = rs.get("metadata", {}), rs.get("spec", {})
    name, annotations = meta.get("name", ""), meta.get("annotations", {}) or {}
    errors = []
    if len(name) > MAX_RAYSERVICE_NAME:
        errors.append(f"RayService name {name!r} is longer than {MAX_RAYSERVICE_NAME} characters")
    if not DNS1035_LABEL.fullmatch(name):
        errors.append(f"RayService name {name!r} is not a DNS-1035 label")
    if INITIALIZING_TIMEOUT in annotations and not _duration_ok(str(annotations[INITIALIZING_TIMEOUT])):
        errors.append(f"annotation {INITIALIZING_TIMEOUT}={annotations[INITIALIZING_TIMEOUT]!r} is invalid")
    cluster = spec.get("rayClusterConfig", {})
    errors += cluster_spec_errors(cluster, annotations)
    head_service = cluster.get("headGroupSpec", {}).get("headService") or {}
    if (head_service.get("metadata") or {}).get("name"):
        errors.append("headGroupSpec.headService.metadata.name should not be set")
    upgrade = (spec.get("upgradeStrategy") or {}).get("type")
    if upgrade is not None and upgrade not in UPGRADE_TYPES:
        errors.append(f"upgradeStrategy.type {upgrade!r} is not one of {sorted(UPGRADE_TYPES)}")
    delay = spec.get("rayClusterDeletionDelaySeconds")
    if delay is not None and delay < 0:
        errors.append(f"rayClusterDeletionDelaySeconds must be >= 0, got {delay}")
    if upgrade == "NewClusterWithIncrementalUpgrade":
        options = (spec.get("upgradeStrategy") or {}).get("clusterUpgradeOptions")
        if not _autoscaling(cluster):
            errors.append("NewClusterWithIncrementalUpgrade needs the Ray autoscaler")
        if not options:
            errors.append("NewClusterWithIncrementalUpgrade needs clusterUpgradeOptions")
        else:
            if not 0 <= options.get("maxSurgePercent", 100) <= 100:
                errors.append("maxSurgePercent must be between 0 and 100")
            if not 0 <= options.get("stepSizePercent", -1) <= 100:
                errors.append("stepSizePercent must be between 0 and 100")
            if options.get("intervalSeconds", 0) <= 0:
                errors.append("intervalSeconds must be greater than 0")
            if not options.get("gatewayClassName"):
                errors.append("gatewayClassName is required for NewClusterWithIncrementalUpgrade")
    return errors
