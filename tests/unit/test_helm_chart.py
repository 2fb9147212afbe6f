"""The Helm chart helm/duet, rendered offline (helm-python-sdk: Helm's own engine
and schema validation, no cluster): every object it renders is valid for
Kubernetes, KubeRay and the Prometheus Operator, the RayService's serveConfigV2
is exactly what `duet serve` would deploy, and bad values fail naming the value."""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import os
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip("helm_python", reason="helm-python-sdk (the `test` extra) renders the chart without a helm binary")
pytest.importorskip("kubernetes_validate",
                    reason="kubernetes-validate (the `test` extra) validates the rendered objects")

import helm_python  # noqa: E402
import jsonschema  # noqa: E402
from helm_chart import (  # noqa: E402
    CHART,
    EXAMPLES,
    KUBE_VERSION,
    ROOT,
    carried_configs,
    cluster_config,
    find,
    load_values,
    merged_values,
    ray_pod_groups,
    ray_start_resources,
    rayservice,
    render,
    render_manifests,
    serve_config_v2,
    validate_object,
)
from kuberay_rules import rayservice_errors  # noqa: E402

from cluster.app import CONTROLLER_ENV  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from cluster.pools import NODE_GROUP_UNITS, node_group_resource  # noqa: E402
from cluster.serve_config import serve_config  # noqa: E402
from routing.openai.access import APIKeys  # noqa: E402

pytestmark = pytest.mark.unit

# The chart's defaults and each example.
CASES = [pytest.param(None, id="defaults"), *(pytest.param(p, id=p.stem) for p in EXAMPLES)]


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch):
    # serve_config() applies this shell's OTEL_* variables; the chart cannot.
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)


def with_values(base: dict | Path | None, **keys) -> dict:
    """`base` (values or a values file) with keys set, nested by `__`: `a__b=1` sets `a.b`."""
    values = copy.deepcopy(load_values(base) if isinstance(base, Path) else (base or {}))
    for key, value in keys.items():
        *parents, last = key.split("__")
        cur = values
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[last] = value
    return values


def test_the_examples_are_the_ones_documented():
    assert [p.name for p in EXAMPLES] == ["autoscaling.yaml", "cpu-small.yaml", "gpu-multinode.yaml"]


@pytest.mark.parametrize("values", CASES)
def test_lint_finds_no_warning_or_error(values):
    report = helm_python.lint(CHART, load_values(values) if values else None, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    # Severity 2 is a warning, 3 an error (1, info: e.g. "icon is recommended").
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_lint_applies_the_values_schema():
    report = helm_python.lint(CHART, with_values(None, workerGroups__prefill__replicas=-1))
    assert any("/workerGroups/prefill/replicas" in e for e in report["errors"])


@pytest.mark.parametrize("values", CASES)
def test_every_rendered_object_is_valid_for_its_api(values):
    objects = render(values)
    used = {obj["kind"]: validate_object(obj) for obj in objects}
    assert used["RayService"] == "kuberay-crd"
    assert used["Service"] == f"kubernetes-{KUBE_VERSION}"


def test_the_validators_reject_what_the_api_would():
    objects = render()
    ray = copy.deepcopy(rayservice(objects))
    ray["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(jsonschema.ValidationError):
        validate_object(ray)
    ray = copy.deepcopy(rayservice(objects))
    ray["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 1  # unknown field
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        validate_object(ray)
    (sts,) = find(objects, "StatefulSet")
    sts = copy.deepcopy(sts)
    sts["spec"]["replicaz"] = 1
    with pytest.raises(Exception, match="replicaz"):
        validate_object(sts)
    monitors = render(CHART / "examples" / "gpu-multinode.yaml")
    (pod_monitor,) = copy.deepcopy(find(monitors, "PodMonitor"))
    pod_monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        validate_object(pod_monitor)


@pytest.mark.parametrize("values", CASES)
def test_the_rayservice_passes_the_operators_own_checks(values):
    """What KubeRay's Go validation refuses after the CRD schema accepted it."""
    assert rayservice_errors(rayservice(render(values))) == []


def test_the_operators_checks_reject_what_the_operator_would():
    ray = rayservice(render(CHART / "examples" / "autoscaling.yaml"))

    def errors(change) -> list[str]:
        broken = copy.deepcopy(ray)
        change(broken)
        return rayservice_errors(broken)

    cluster = lambda r: r["spec"]["rayClusterConfig"]  # noqa: E731
    head = lambda r: cluster(r)["headGroupSpec"]  # noqa: E731
    assert errors(lambda r: r["metadata"].update(name="x" * 48))
    assert errors(lambda r: r["metadata"].update(name="Duet_1"))
    assert errors(lambda r: r["metadata"].update(annotations={"ray.io/initializing-timeout": "soon"}))
    assert errors(lambda r: head(r).update(resources={"CPU": "1"}))
    assert errors(lambda r: cluster(r)["workerGroupSpecs"][0]["rayStartParams"].update(labels="a=b"))
    assert errors(lambda r: cluster(r)["workerGroupSpecs"][0].update(labels={"bad key!": "x"}))
    assert errors(lambda r: head(r)["template"]["spec"]["containers"][0].setdefault("env", []).append(
        {"name": "RAY_REDIS_ADDRESS", "value": "redis:6379"}))
    assert errors(lambda r: cluster(r)["workerGroupSpecs"][0].update(suspend=True))
    assert errors(lambda r: r["spec"].update(upgradeStrategy={"type": "Rolling"}))
    assert errors(lambda r: r["spec"].update(rayClusterDeletionDelaySeconds=-1))
    assert errors(lambda r: head(r).update(headService={"metadata": {"name": "mine"}}))
    assert errors(lambda r: cluster(r).update(authOptions={"mode": "token"}, rayVersion="2.51.0"))
    assert errors(lambda r: r["spec"].update(upgradeStrategy={"type": "NewClusterWithIncrementalUpgrade"}))


def test_the_monitors_select_the_ray_pods_and_the_gateway_service():
    objects = render(CHART / "examples" / "gpu-multinode.yaml")
    (pod_monitor,) = find(objects, "PodMonitor")
    selector = pod_monitor["spec"]["selector"]
    (expression,) = selector["matchExpressions"]
    for group in ray_pod_groups(objects).values():
        template = group["template"]
        labels = template["metadata"]["labels"]
        assert selector["matchLabels"].items() <= labels.items()
        assert labels[expression["key"]] in expression["values"]
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports[pod_monitor["spec"]["podMetricsEndpoints"][0]["port"]] == 8080
    (service_monitor,) = find(objects, "ServiceMonitor")
    service = next(o for o in find(objects, "Service") if o["metadata"]["name"] == "duet")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize("values", CASES)
def test_serve_config_v2_is_what_duet_serve_deploys(values):
    cfg = cluster_config(values)
    expected = serve_config(cfg)
    actual = serve_config_v2(render(values))

    rest, carried = carried_configs(actual)
    assert (rest, carried) == carried_configs(expected)  # the configs as configs, the rest exactly
    assert carried == [cfg] * (2 if cfg.scaled_pools("goodput") else 1)

    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config_v2(render(values)))


def test_the_autoscaling_example_carries_the_goodput_policy():
    path = CHART / "examples" / "autoscaling.yaml"
    app = serve_config_v2(render(path))["applications"][0]
    assert app["autoscaling_policy"]["policy_function"] == "cluster.autoscaler:GoodputAutoscaler"
    carried = ClusterConfig.model_validate(app["autoscaling_policy"]["policy_kwargs"]["config"])
    assert carried.scaled_pools("goodput").keys() == {"prefill", "decode"}
    assert carried.prefill.autoscaling.load_profile().prefill_model.b_ms_per_token > 0  # numbers, not a file
    cluster = rayservice(render(path))["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["upscalingMode"] == "Default"


def test_a_queue_scaled_pool_gets_no_app_level_policy():
    values = with_values(None, duet__prefill__autoscaling={"policy": "queue", "max_replicas": 2})
    assert "autoscaling_policy" not in serve_config_v2(render(values))["applications"][0]
    # No `policy:` means goodput, as in PoolAutoscaling.
    values = with_values(None, duet__prefill__autoscaling={"max_replicas": 2})
    assert "autoscaling_policy" in serve_config_v2(render(values))["applications"][0]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_duet_section_is_a_cluster_config(path):
    ClusterConfig.model_validate(load_values(path)["duet"])


def test_the_values_schema_is_generated_from_the_cluster_config():
    spec = importlib.util.spec_from_file_location("generate_schema", ROOT / "helm" / "generate_schema.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (CHART / "values.schema.json").read_text() == module.render(), \
        "stale: run .venv/bin/python helm/generate_schema.py"
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["duet"]["properties"].keys() == ClusterConfig.model_fields.keys()


def test_the_ray_version_is_the_one_duet_pins():
    assert rayservice(render())["spec"]["rayClusterConfig"]["rayVersion"] == version("ray")


@pytest.mark.parametrize("values", CASES)
def test_worker_groups_offer_their_node_group_and_the_pools_fit(values):
    objects = render(values)
    merged = merged_values(values)
    groups = ray_pod_groups(objects)
    assert groups.keys() == {"head", *merged["workerGroups"]}
    for name, group in groups.items():
        offered = merged["head"]["nodeGroups"] if name == "head" else [name]
        assert ray_start_resources(group) == {node_group_resource(g): NODE_GROUP_UNITS for g in offered}
        text = group["rayStartParams"].get("resources", "")
        assert not text or (text[0] == text[-1] == "'")  # one shell word in KubeRay's `ray start` line
        assert group["rayStartParams"]["metrics-export-port"] == "8080"

    # Each pool fits its node group at its largest size (the ingress pool's replicas
    # with the gateway inside).
    cfg = cluster_config(values)
    need: dict[str, list[float]] = {}
    for pool in cfg.pools().values():
        n = pool.autoscaling.max_replicas if pool.scaling != "fixed" else pool.replicas
        cpus_gpus = need.setdefault(pool.node_group, [0.0, 0.0])
        gateway = cfg.gateway.num_cpus if pool is cfg.pools()[cfg.ingress_deployment()] else 0.0
        cpus_gpus[0] += n * (pool.num_cpus + gateway)
        cpus_gpus[1] += n * pool.num_gpus
    for node_group, (cpus, gpus) in need.items():  # None: any pod
        holders = [(g, 1 if n == "head" else g["maxReplicas"]) for n, g in groups.items()
                   if node_group is None or node_group_resource(node_group) in ray_start_resources(g)]
        assert sum(int(g["rayStartParams"]["num-cpus"]) * pods for g, pods in holders) >= cpus, node_group
        assert sum(int(g["rayStartParams"].get("num-gpus", 0)) * pods for g, pods in holders) >= gpus, node_group


@pytest.mark.parametrize("values", CASES)
def test_the_ray_autoscaler_reads_each_group_as_the_pods_start(values):
    # Ray 2.60's KubeRay autoscaler plans pods from these (its own parser of the
    # group spec): a replica waiting for duet/<group> must make it add a <group> pod.
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    for name, group in ray_pod_groups(render(values)).items():
        seen = _get_ray_resources_from_group_spec(group, name == "head")
        params = group["rayStartParams"]
        assert seen["CPU"] == int(params["num-cpus"])
        assert seen.get("GPU", 0) == int(params.get("num-gpus", 0))
        custom = {k: v for k, v in seen.items() if k not in ("CPU", "GPU", "memory")}
        assert custom == ray_start_resources(group)


def test_gpu_and_rdma_workers():
    objects = render(CHART / "examples" / "gpu-multinode.yaml")
    for name in ("prefill", "decode"):
        group = ray_pod_groups(objects)[name]
        assert group["rayStartParams"]["num-gpus"] == "1"
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
        assert limits["rdma/rdma_shared_device_a"] == "1"
        assert container["resources"]["requests"] == limits
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    head = ray_pod_groups(render())["head"]
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "num-gpus" not in head["rayStartParams"]


def test_the_gateway_service_targets_the_head_serve_port():
    objects = render(with_values(None, duet__gateway__port=8123))
    service = next(o for o in find(objects, "Service") if o["metadata"]["name"] == "duet")
    head = ray_pod_groups(objects)["head"]["template"]
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert ports["serve"] == 8123 and service["spec"]["ports"][0]["targetPort"] == "serve"
    assert serve_config_v2(objects)["http_options"] == {"host": "0.0.0.0", "port": 8123}


def test_api_keys_become_a_secret_mounted_in_every_ray_pod(tmp_path):
    values = with_values(None, apiKeys__keys=["key-one", "key-two"],
                         duet__gateway__api_keys_file="/etc/duet/api-keys/keys")
    objects = render(values)
    (secret,) = find(objects, "Secret")
    keys_file = tmp_path / "keys"
    keys_file.write_bytes(base64.b64decode(secret["data"]["keys"]))
    assert len(APIKeys.load(str(keys_file), env={})) == 2  # the gateway's own reader
    for group in ray_pod_groups(objects).values():
        spec = group["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        (mount,) = spec["containers"][0]["volumeMounts"]
        assert mount == {"name": "api-keys", "mountPath": "/etc/duet/api-keys", "readOnly": True}

    # A Secret of one's own: mounted, none rendered.
    objects = render(with_values(CHART / "examples" / "gpu-multinode.yaml"))
    assert find(objects, "Secret") == []
    volumes = ray_pod_groups(objects)["head"]["template"]["spec"]["volumes"]
    assert volumes[0]["secret"]["secretName"] == "duet-api-keys"
    # No keys: nothing mounted.
    assert "volumes" not in ray_pod_groups(render())["head"]["template"]["spec"]


def test_redis_renders_or_is_replaced_by_an_external_one():
    assert {o["kind"] for o in render() if o["metadata"]["name"] == "duet-redis"} == {"Service", "StatefulSet"}
    values = with_values(None, redis__enabled=False, redis__externalUrl="redis://redis.infra:6379",
                         duet__router__redis_url="redis://redis.infra:6379/0")
    objects = render(values)
    assert [o for o in objects if "redis" in o["metadata"]["name"]] == []
    assert find(objects, "StatefulSet") == []


def test_optional_objects_are_off_by_default():
    kinds = {o["kind"] for o in render()}
    assert kinds == {"RayService", "Service", "StatefulSet"}
    assert "NOTES.txt" in " ".join(render_manifests())


@pytest.mark.parametrize(("values", "message"), [
    (with_values(None, workerGroups__prefill__replicas=-1), "/workerGroups/prefill/replicas"),
    (with_values(None, workerGroups__extra={"replicas": 1}), "missing property 'resources'"),
    (with_values(None, workerGroups__extra={"replicas": 1, "resources": {"memory": "2Gi"}}),
     "/workerGroups/extra/resources.*missing property 'cpu'"),
    (with_values(None, replicaz=1), "additional properties 'replicaz' not allowed"),
    (with_values(None, head__replicas=1), "/head.*additional properties 'replicas' not allowed"),
    (with_values(None, duet__prefill__replicaz=2), "/duet/prefill.*additional properties 'replicaz' not allowed"),
    (with_values(None, duet__prefill__replicas=0), "/duet/prefill/replicas"),
    (with_values(None, workerGroups__Bad_Name={"replicas": 1, "resources": {"cpu": 1, "memory": "1Gi"}}),
     "Bad_Name"),
], ids=["negative-replicas", "no-resources", "no-cpu", "unknown-key", "unknown-head-key", "unknown-duet-key",
        "duet-zero-replicas", "bad-group-name"])
def test_the_schema_rejects_bad_values_naming_them(values, message):
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render(values)


@pytest.mark.parametrize(("values", "release", "message"), [
    (with_values(None, duet__prefill__node_group="gpu"), "duet",
     r'duet.prefill.node_group: "gpu" is not a node group of this release \(head.nodeGroups and workerGroups '
     r"offer: decode, prefill\)"),
    (with_values(None, duet__gateway__host="127.0.0.1"), "duet", "duet.gateway.host"),
    (with_values(None, workerGroups__prefill__minReplicas=2), "duet", "workerGroups.prefill.minReplicas: 2"),
    (with_values(None, workerGroups__decode__maxReplicas=1, workerGroups__decode__replicas=2), "duet",
     "workerGroups.decode.maxReplicas: 1"),
    (with_values(None, duet__decode__autoscaling={"profile": "profiles/cpu.json"}), "duet",
     "duet.decode.autoscaling.profile"),
    (None, "other", r"duet.router.redis_url: .* use redis://other-duet-redis:6379/<db>"),
    (with_values(None, duet__cache__redis_url="redis://elsewhere:6379/1"), "duet", "duet.cache.redis_url"),
    (with_values(None, redis__externalUrl="redis://x:6379"), "duet", "redis.externalUrl"),
    (with_values(None, apiKeys__keys=["k"]), "duet", "duet.gateway.api_keys_file"),
    (with_values(None, duet__gateway__api_keys_file="/etc/duet/api-keys/keys"), "duet",
     "duet.gateway.api_keys_file.*no keys"),
], ids=["pool-node-group", "gateway-host", "min-above-replicas", "max-below-replicas",
        "profile-path", "redis-release", "cache-redis", "redis-both", "keys-unread", "keys-missing"])
def test_templates_fail_on_values_that_do_not_fit_together(values, release, message):
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values, release=release)


def test_a_pool_outside_the_mode_needs_no_node_group():
    values = with_values(None, duet__mode="aggregated", duet__prefill__node_group="absent",
                         duet__aggregated={"node_group": "prefill", "num_cpus": 1})
    assert ClusterConfig.model_validate(serve_config_v2(render(values))["applications"][0]["args"]["config"]).mode \
        == "aggregated"


def test_a_default_worker_group_can_be_dropped():
    values = with_values(None, workerGroups__decode=None, duet__decode__node_group="prefill")
    assert ray_pod_groups(render(values)).keys() == {"head", "prefill"}


def test_the_haproxy_ingress_is_set_on_every_ray_pod_by_default():
    """`gateway.ingress: haproxy` (the default) is a Ray cluster setting, read by every
    Ray process: each pod's container gets it, beside the group's own env; with
    `gateway.ingress: proxy`, none does."""
    haproxy = {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"}
    body = {"name": "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY", "value": "1"}  # the ingress router reads it
    values = with_values(None, head__env=[{"name": "A", "value": "b"}])
    for name, group in ray_pod_groups(render(values)).items():
        env = group["template"]["spec"]["containers"][0]["env"]
        assert haproxy in env and body in env, name
        if name == "head":
            assert {"name": "A", "value": "b"} in env
    for group in ray_pod_groups(render(with_values(None, duet__gateway__ingress="proxy"))).values():
        assert haproxy not in group["template"]["spec"]["containers"][0].get("env", [])


def test_the_serve_controller_loop_is_the_one_duet_serve_runs():
    """The controller runs on the head pod and reads its loop interval from there; a
    group's own env entry for it replaces the chart's."""
    def head_env(values=None) -> list[dict]:
        return ray_pod_groups(render(values))["head"]["template"]["spec"]["containers"][0]["env"]

    assert all({"name": name, "value": value} in head_env() for name, value in CONTROLLER_ENV.items())
    mine = {"name": "RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "value": "0.1"}  # an operator's own wins
    assert [e for e in head_env(with_values(None, head__env=[mine])) if e["name"] == mine["name"]] == [mine]
