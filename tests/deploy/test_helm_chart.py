"""The Helm chart, checked with a real helm against real schemas (no Kubernetes API here).

Each value set (the defaults and deploy/helm/tandem/ci/*.yaml) must lint strictly, render,
validate against Kubernetes' own schemas (kubernetes-validate) and, for the RayService, against
KubeRay's CRD; its serveConfigV2 must be Tandem's own application config, loaded by the loader
`tandem up` uses and built by Ray Serve's own builder. Broken values must fail with the schema's
message, and a cluster without KubeRay with a clear one.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import socket
import subprocess
import sys
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tandem.services.serving.config import AppConfig
from tests.deploy.conftest import (
    CHART_DIR,
    NAMESPACE,
    RELEASE,
    REPO_ROOT,
    SHARED_SCHEMAS,
    Helm,
    HelmError,
)

VALUE_SETS: dict[str, Path | None] = {
    "default": None, **{p.stem: p for p in sorted((CHART_DIR / "ci").glob("*.yaml"))}}
SKIP_KUBERAY_CHECK = ("--set", "kuberay.skipCapabilityCheck=true")
# The chart's kubeVersion floor and a current release: both ship with kubernetes-validate.
K8S_VERSIONS = ("1.27.0", "1.35.0")
CRD_KINDS = {"RayService", "ServiceMonitor", "PrometheusRule"}
ROLES = ("prefill", "decode")
# AppConfig settings the chart sets itself, from its own keys (the rest come from `app:`).
CHART_OWNED = {"model", "host", "port", "grpc_port", "worker_host", "redis_url",
               "prefill_replicas", "decode_replicas", "gateway_replicas", "colocated",
               "ray_address",
               "gateway_resource", "prefill_resource", "decode_resource"}
# Set by the chart from `auth:`, `tls:` and `internalTls:` (the Secrets it mounts), and only
# when configured: the cluster secret always, the API keys, metrics_require_key and the TLS
# files when given (test_chart_security.py).
AUTH_OWNED = frozenset({"api_keys_file", "cluster_secret_file", "metrics_require_key",
                        "tls_cert_file", "tls_key_file", "internal_tls_cert_file",
                        "internal_tls_key_file", "internal_tls_ca_file"})
WILDCARDS = ("0.0.0.0", "::", "")
MIN_HEAD_MEMORY = 4 * 1024**3  # the gateway (tokenizer, prefix index, open streams) + Ray


def test_value_sets_cover_the_issue() -> None:
    assert {"small-1p1d-values", "large-4p8d-autoscaling-values",
            "external-redis-values", "dev-api-keys-values"} <= set(VALUE_SETS)


# ---------------------------------------------------------------------------- rendering


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def values_for(name: str) -> dict[str, Any]:
    """The values helm sees for a value set: the chart's defaults with the set's file on top."""
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    path = VALUE_SETS[name]
    return _deep_merge(defaults, yaml.safe_load(path.read_text())) if path else defaults


def render_args(name: str) -> tuple[str, ...]:
    path = VALUE_SETS[name]
    if path is None:
        # The defaults go through the real capability check: as a cluster with KubeRay and the
        # Prometheus operator would answer it.
        return ("--api-versions", "ray.io/v1/RayService",
                "--api-versions", "monitoring.coreos.com/v1")
    return ("-f", str(path), *SKIP_KUBERAY_CHECK)


@dataclass
class Rendered:
    name: str
    values: dict[str, Any]
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, suffix: str = "") -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"].endswith(suffix)]
        assert len(found) == 1, f"{self.name}: expected one {kind} *{suffix}, got {len(found)}"
        return found[0]

    @property
    def ray_service(self) -> dict[str, Any]:
        return self.one("RayService")

    @property
    def cluster(self) -> dict[str, Any]:
        return self.ray_service["spec"]["rayClusterConfig"]

    @property
    def serve_config(self) -> dict[str, Any]:
        return yaml.safe_load(self.ray_service["spec"]["serveConfigV2"])

    @property
    def application(self) -> dict[str, Any]:
        (app,) = self.serve_config["applications"]
        return app

    def deployment_options(self, name: str) -> dict[str, Any]:
        (options,) = [d for d in self.application["deployments"] if d["name"] == name]
        return options

    def group(self, component: str) -> dict[str, Any]:
        if component == "head":
            return self.cluster["headGroupSpec"]
        (group,) = [g for g in self.cluster["workerGroupSpecs"] if g["groupName"] == component]
        return group

    def ray_groups(self) -> list[str]:
        """The RayService's pod groups: the head, the gateway pods beside it (when any), the
        engines."""
        return ["head", *(["gateway"] if self.values["gateway"]["replicas"] else []), *ROLES]

    def pod_templates(self) -> dict[str, dict[str, Any]]:
        """Every pod this release runs, by component."""
        pods = {c: self.group(c)["template"] for c in self.ray_groups()}
        for deployment in self.of_kind("Deployment"):
            component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
            pods[component] = deployment["spec"]["template"]
        return pods


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def rendered(request: pytest.FixtureRequest, helm: Helm) -> Rendered:
    name = request.param
    return Rendered(name, values_for(name), helm.template(*render_args(name)))


def initial_replicas(role_values: dict[str, Any]) -> int:
    scaling = role_values["autoscaling"]
    return int(scaling["minReplicas"] if scaling["enabled"] else role_values["replicas"])


def max_replicas(role_values: dict[str, Any]) -> int:
    scaling = role_values["autoscaling"]
    return int(scaling["maxReplicas"] if scaling["enabled"] else role_values["replicas"])


_QUANTITY = re.compile(r"^([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T|m)?$")
_UNITS = {None: 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "k": 1e3,
          "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}


def quantity(value: str | int | float) -> float:
    match = _QUANTITY.match(str(value))
    assert match, f"not a Kubernetes quantity: {value!r}"
    return float(match.group(1)) * _UNITS[match.group(2)]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def other_release(labels: dict[str, str]) -> dict[str, str]:
    return {**labels, "app.kubernetes.io/instance": f"not-{RELEASE}"}


# ---------------------------------------------------------------- lint and schemas


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_lint_strict(helm: Helm, name: str) -> None:
    path = VALUE_SETS[name]
    args = ("-f", str(path)) if path else ()
    out = helm.check("lint", "--strict", str(CHART_DIR), *args, *SKIP_KUBERAY_CHECK)
    assert "1 chart(s) linted, 0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


def test_objects_validate_against_kubernetes_schemas(rendered: Rendered) -> None:
    core = [o for o in rendered.objects if o["kind"] not in CRD_KINDS]
    assert "Service" in {o["kind"] for o in core}
    for version in K8S_VERSIONS:
        for obj in core:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{rendered.name}: {obj['kind']} {obj['metadata']['name']} is not "
                            f"valid Kubernetes {version}: {exc.message} at {list(exc.path)}")


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected: the API server would silently prune them, so
    a misplaced field would vanish rather than fail."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if (out.get("type") == "object" and isinstance(out.get("properties"), dict)
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="session")
def rayservice_schema() -> dict[str, Any]:
    crd = yaml.safe_load((SHARED_SCHEMAS / "kuberay" / "ray.io_rayservices.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(v1["schema"]["openAPIV3Schema"])


def test_rayservice_validates_against_kuberay_crd(rendered: Rendered,
                                                  rayservice_schema: dict[str, Any]) -> None:
    service = rendered.ray_service
    assert service["apiVersion"] == "ray.io/v1"
    errors = sorted(jsonschema.Draft7Validator(rayservice_schema).iter_errors(service),
                    key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


def test_crd_check_catches_a_misplaced_field(rendered: Rendered,
                                             rayservice_schema: dict[str, Any]) -> None:
    broken = copy.deepcopy(rendered.ray_service)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["replicas"] = 1
    with pytest.raises(jsonschema.ValidationError, match="replicas"):
        jsonschema.validate(broken, rayservice_schema, cls=jsonschema.Draft7Validator)


# ------------------------------------------------------------------ the application


def test_serve_config_is_tandems_application(helm: Helm, tmp_path: Path,
                                             rendered: Rendered) -> None:
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app
    from ray.serve.schema import ServeDeploySchema

    values = rendered.values
    # The secret files sit where the chart mounts them, should AppConfig check they exist.
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "api-keys").write_text("ci:ci-test-key-not-a-secret\n")
    (secrets / "cluster-secret").write_text("c" * 48)
    extra: tuple[str, ...] = ("--set", f"auth.secretsMountPath={secrets}")
    if values["model"]["path"]:
        # AppConfig checks that the model exists: mount the chart's model path on a real one.
        (tmp_path / values["model"]["path"]).mkdir(parents=True)
        extra += ("--set", f"model.mountPath={tmp_path}")
    ours = Rendered(rendered.name, values,
                    helm.template(*render_args(rendered.name), *extra))
    serve = ServeDeploySchema.model_validate(ours.serve_config)
    # No Serve HTTP proxy: the gateway replica serves HTTP on ports.http itself (below).
    assert serve.proxy_location == "Disabled"
    app = ours.application
    assert app["import_path"] == "tandem.services.app:app_builder"
    args = app["args"]
    auth = set(args) & AUTH_OWNED
    assert set(args) - set(values["app"]) - auth == CHART_OWNED
    assert args["cluster_secret_file"] == str(secrets / "cluster-secret")
    # The auth settings are a fixed interface (issue 18) that AppConfig is gaining alongside
    # this chart: those it does not know yet are checked above and left out of the rest.
    known = {f.name for f in fields(AppConfig)}
    args = {k: v for k, v in args.items() if k in known or k not in AUTH_OWNED}

    # `tandem up --config FILE` reads the same settings through AppConfig.from_yaml.
    config_file = tmp_path / "app.yaml"
    config_file.write_text(yaml.safe_dump(args))
    config = AppConfig.from_yaml(config_file)
    assert config == AppConfig.from_dict(args, "serveConfigV2")
    assert config.host in WILDCARDS and config.worker_host in WILDCARDS
    assert (config.port, config.grpc_port) == (values["ports"]["http"], values["ports"]["grpc"])
    assert config.prefill_replicas == initial_replicas(values["prefill"])
    assert config.decode_replicas == initial_replicas(values["decode"])
    assert not config.colocated
    if values["model"]["path"]:
        assert Path(config.model) == tmp_path / values["model"]["path"]
    elif values["model"]["hubId"]:
        # The engines resolve the id from the hub cache the init containers filled.
        assert config.model == values["model"]["hubId"]
    else:
        assert config.model is None
    for key, value in values["app"].items():
        assert getattr(config, key) == value, key
    for key in auth & known:
        assert getattr(config, key) == args[key], key

    # Serve's own path: import, call the builder with the args, build, apply the overrides.
    application = call_user_app_builder_with_args_if_necessary(import_attr(app["import_path"]),
                                                               args)
    built = build_app(application, name=app["name"])
    by_name = {d.name: d for d in built.deployments}
    assert built.ingress_deployment_name == "gateway"
    assert by_name["gateway"].init_args[0] == config
    assert {d["name"] for d in app["deployments"]} == set(by_name)
    for override in app["deployments"]:
        options = {k: v for k, v in override.items() if k != "name"}
        by_name[override["name"]].options(**options)  # Serve validates the combination


def test_default_kv_cache_is_sized_from_the_gpu(helm: Helm) -> None:
    """The defaults leave kv_cache_memory_gb unset: each GPU engine takes
    gpu_memory_utilization of its GPU (weights, a profiling step, then KV blocks)."""
    args = Rendered("default", values_for("default"),
                    helm.template(*render_args("default"))).application["args"]
    assert "kv_cache_memory_gb" not in args and "num_kv_blocks" not in args
    assert args["gpu_memory_utilization"] == AppConfig().gpu_memory_utilization == 0.9


def test_deployments_land_on_their_groups(rendered: Rendered) -> None:
    """Each Serve deployment asks for a custom Ray resource that only its groups provide, one
    per pod, and for the GPUs its pod has: the gateway on the head and on each gateway pod (a
    replica for each), the engines on their own groups."""
    gateways = ["head", *(["gateway"] if rendered.values["gateway"]["replicas"] else [])]
    home = {"gateway": gateways, "prefill": ["prefill"], "decode": ["decode"]}
    provided = {c: rendered.group(c).get("resources", {}) for c in rendered.ray_groups()}
    for deployment, components in home.items():
        actor = rendered.deployment_options(deployment)["ray_actor_options"]
        assert actor["num_cpus"] == 0
        for resource, amount in actor["resources"].items():
            providers = [c for c, res in provided.items() if resource in res]
            assert providers == components, (deployment, resource, providers)
            for component in components:
                assert float(provided[component][resource]) == amount == 1
        container = rendered.group(components[0])["template"]["spec"]["containers"][0]
        gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        assert actor.get("num_gpus", 0) == gpus
        if deployment == "gateway":
            # Serve runs one per gateway pod and one on the head: one per node providing it.
            pods = 1 + rendered.values["gateway"]["replicas"]
            assert rendered.application["args"]["gateway_replicas"] == pods
            if len(gateways) > 1:
                group = rendered.group("gateway")
                assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] \
                    == pods - 1
        else:
            ranks = rendered.values["app"].get("tensor_parallel_size", 1)
            assert gpus == rendered.values[component]["gpusPerReplica"] * ranks
    assert rendered.group("head")["rayStartParams"]["num-cpus"] == "0"


def test_tensor_parallel_worker_pods_get_a_gpu_per_rank(helm: Helm) -> None:
    """app.tensor_parallel_size 2: each decode and prefill pod (and its Serve replica) has
    2 x gpusPerReplica GPUs."""
    settings = ("--set", "app.tensor_parallel_size=2", "--set", "decode.gpusPerReplica=1",
                "--set", "prefill.gpusPerReplica=2")
    rendered = Rendered("tp2", values_for("small-1p1d-values"),
                        helm.template(*render_args("small-1p1d-values"), *settings))
    assert rendered.application["args"]["tensor_parallel_size"] == 2
    for role, gpus in (("decode", 2), ("prefill", 4)):
        container = rendered.group(role)["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"].get("nvidia.com/gpu", 0) == gpus, role
        assert rendered.deployment_options(role)["ray_actor_options"]["num_gpus"] == gpus, role


def test_each_group_takes_its_scheduling_settings_and_the_accelerator_resource(
        helm: Helm, tmp_path: Path) -> None:
    """Per group (head, gateway pods, prefill, decode): topology spread, priority class,
    runtime class and scheduler name reach its pod spec (none by default); GPUs are asked for
    under the accelerator's resource name (here a MIG profile)."""
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
               "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "decode"}}}]
    overrides: dict[str, Any] = {"accelerator": {"resource": "nvidia.com/mig-3g.40gb"},
                                 "gateway": {"replicas": 1}}
    for group in ("head", "gateway", *ROLES):
        overrides[group] = overrides.get(group, {}) | {
            "priorityClassName": f"{group}-priority", "runtimeClassName": "nvidia",
            "schedulerName": "volcano", "topologySpreadConstraints": spread}
    values = tmp_path / "scheduling.yaml"
    values.write_text(yaml.safe_dump(overrides))
    rendered = Rendered("scheduling", _deep_merge(values_for("small-1p1d-values"), overrides),
                        helm.template(*render_args("small-1p1d-values"), "-f", str(values)))
    default = Rendered("default", values_for("default"), helm.template(*render_args("default")))
    for group in ("head", "gateway", *ROLES):
        spec = rendered.group(group)["template"]["spec"]
        assert (spec["priorityClassName"], spec["runtimeClassName"], spec["schedulerName"],
                spec["topologySpreadConstraints"]) == (f"{group}-priority", "nvidia", "volcano",
                                                       spread), group
        if group == "gateway":  # no gateway pods by default
            continue
        plain = default.group(group)["template"]["spec"]
        assert not {"priorityClassName", "runtimeClassName", "schedulerName",
                    "topologySpreadConstraints"} & set(plain), group
    for role in ROLES:
        limits = rendered.group(role)["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits.get("nvidia.com/mig-3g.40gb") == 1 and "nvidia.com/gpu" not in limits


def test_worker_groups_follow_values(rendered: Rendered) -> None:
    values = rendered.values
    scaling = any(values[role]["autoscaling"]["enabled"] for role in ROLES)
    planner = values["planner"]["enabled"]  # sets Serve's counts: the Ray autoscaler adds pods
    assert rendered.cluster["enableInTreeAutoscaling"] is (scaling or planner)
    if any("idleTimeoutSeconds" in rendered.group(role) for role in ROLES):
        # KubeRay's validation: per-group idle timeouts need autoscaler v2.
        assert rendered.cluster["autoscalerOptions"]["version"] == "v2"
    for role in ROLES:
        group, role_values = rendered.group(role), values[role]
        assert group["replicas"] == initial_replicas(role_values)
        low, high = initial_replicas(role_values), max_replicas(role_values)
        if planner:  # room for every count the planner may set
            bounds = values["planner"]["bounds"][role]
            low, high = min(low, bounds["min"]), max(high, bounds["max"])
        assert (group["minReplicas"], group["maxReplicas"]) == (low, high)
        spec = group["template"]["spec"]
        assert spec.get("nodeSelector", {}) == role_values["nodeSelector"]
        assert spec.get("tolerations", []) == role_values["tolerations"]
        assert spec.get("affinity", {}) == role_values["affinity"]
        options = rendered.deployment_options(role)
        if role_values["autoscaling"]["enabled"]:
            # Serve's replica bounds and the group's pod bounds move in lockstep.
            assert options["num_replicas"] == "auto"
            bounds = options["autoscaling_config"]
            assert (bounds["min_replicas"], bounds["max_replicas"]) == (
                role_values["autoscaling"]["minReplicas"],
                role_values["autoscaling"]["maxReplicas"])
            assert group["minReplicas"] <= bounds["min_replicas"]
            assert group["maxReplicas"] >= bounds["max_replicas"]
        else:
            assert "autoscaling_config" not in options


# ----------------------------------------------------------------------- pods


def containers_of(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """A pod spec's containers, its init containers (model.hubId's fetch) first."""
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_pods_run_non_root_on_a_read_only_root(rendered: Rendered) -> None:
    for component, template in rendered.pod_templates().items():
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, component
        assert pod["securityContext"]["runAsUser"] != 0, component
        for container in containers_of(pod):
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, component
            assert security["allowPrivilegeEscalation"] is False, component
            assert security["capabilities"]["drop"] == ["ALL"], component
    for component in rendered.ray_groups():
        spec = rendered.group(component)["template"]["spec"]
        empty_dirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        for path in ("/tmp", "/tmp/ray", "/dev/shm"):
            assert mounts.get(path) in empty_dirs, (component, path)


def test_resources_are_bounded_and_the_head_is_not_tiny(rendered: Rendered) -> None:
    for component, template in rendered.pod_templates().items():
        for container in containers_of(template["spec"]):
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), component
            assert "memory" in resources["limits"], component
            assert (quantity(resources["requests"]["memory"])
                    <= quantity(resources["limits"]["memory"])), component
    head = rendered.group("head")["template"]["spec"]["containers"][0]["resources"]
    assert quantity(head["limits"]["memory"]) >= MIN_HEAD_MEMORY


def test_model_volume_is_mounted_read_only_everywhere(rendered: Rendered) -> None:
    model = rendered.values["model"]
    for component in rendered.ray_groups():
        spec = rendered.group(component)["template"]["spec"]
        mounts = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model"]
        if not model["path"]:
            assert not mounts
            continue
        assert mounts == [{"name": "model", "mountPath": model["mountPath"], "readOnly": True}]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
        assert {k: v for k, v in volume.items() if k != "name"} == model["volume"]


# ----------------------------------------------------------------- networking


def test_services_reach_every_gateway(rendered: Rendered) -> None:
    """The HTTP and gRPC Services select the pods running a gateway replica (the head and the
    gateway pods), and no engine pod; a gateway pod is in them once its gateway answers."""
    gateways = [g for g in rendered.ray_groups() if g in ("head", "gateway")]
    config = rendered.application["args"]
    for kind, app_port in (("http", config["port"]), ("grpc", config["grpc_port"])):
        service = rendered.one("Service", f"-{kind}")
        assert service["spec"]["selector"]
        for group in gateways:
            pod = rendered.group(group)["template"]
            assert selects({"matchLabels": service["spec"]["selector"]},
                           pod["metadata"]["labels"]), group
            assert app_port in {p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        for role in ROLES:
            assert not selects({"matchLabels": service["spec"]["selector"]},
                               rendered.group(role)["template"]["metadata"]["labels"])
        (port,) = service["spec"]["ports"]
        assert port["name"] == kind
        assert port["targetPort"] == app_port
        assert port["port"] == rendered.values["service"][kind]["port"]
    if "gateway" in gateways:
        (container,) = rendered.group("gateway")["template"]["spec"]["containers"]
        probe = " ".join(container["readinessProbe"]["exec"]["command"])
        scheme = "https" if rendered.values["tls"]["existingSecret"] else "http"
        assert f"{scheme}://localhost:{config['port']}/-/healthz" in probe
    assert rendered.serve_config["proxy_location"] == "Disabled"  # the gateway owns the port
    # So no worker's readiness may wait for a Serve proxy (KubeRay's default probe would).
    for role in ROLES:
        (container,) = rendered.group(role)["template"]["spec"]["containers"]
        probe = " ".join(container["readinessProbe"]["exec"]["command"])
        assert "local_raylet_healthz" in probe and str(config["port"]) not in probe


def test_worker_pods_drain_before_they_stop(rendered: Rendered) -> None:
    """Deleting a worker pod drains its node (Serve moves the replicas, stops these after
    drain_timeout_s, their streams migrate); the pod is given the time for it."""
    drain = rendered.application["args"]["drain_timeout_s"]
    for role in ROLES:
        spec = rendered.group(role)["template"]["spec"]
        (container,) = spec["containers"]
        hook = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
        assert "ray drain-node" in hook and f"--deadline-remaining-seconds {int(drain)}" in hook
        assert spec["terminationGracePeriodSeconds"] > drain + 20  # the hook's own bound


def test_network_policy_admits_cluster_traffic_only_from_the_release(rendered: Rendered) -> None:
    values = rendered.values
    policies = rendered.of_kind("NetworkPolicy")
    if not values["networkPolicy"]["enabled"]:
        assert not policies
        return
    pods = rendered.pod_templates()
    ray_policy = rendered.one("NetworkPolicy", "-ray")
    for component in rendered.ray_groups():
        assert selects(ray_policy["spec"]["podSelector"], pods[component]["metadata"]["labels"])
    np = values["networkPolicy"]
    ingress = [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": np["ingressNamespace"]}}}] if np["ingressNamespace"] else []
    operator = [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": np["operatorNamespace"]}},
        "podSelector": {"matchLabels": np["operatorPodLabels"]}}]
    public = {values["ports"]["http"]: ingress + np["prometheusFrom"] + np["httpFrom"],
              values["ports"]["grpc"]: ingress + np["grpcFrom"],
              8265: operator if np["dashboard"] else []}
    if np["allowAnySource"]:
        public[values["ports"]["http"]] = public[values["ports"]["grpc"]] = None
    open_ports: set[int] = set()
    for rule in ray_policy["spec"]["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports:
            # A public port: open to exactly the sources configured for it (None: any).
            (port,) = ports
            assert rule.get("from") == public[port], port
            open_ports.add(port)
            continue
        # Every port (Ray, KV transfer, control): only this release's pods, same namespace.
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, peer
            for labels in (pods[c]["metadata"]["labels"] for c in rendered.ray_groups()):
                assert selects(peer["podSelector"], labels)
                assert not selects(peer["podSelector"], other_release(labels))
    # A port with no sources has no rule (a rule without `from` would admit any source).
    assert open_ports == {port for port, peers in public.items() if peers != []}
    if "redis" in pods:
        redis_policy = rendered.one("NetworkPolicy", "-redis")
        assert selects(redis_policy["spec"]["podSelector"], pods["redis"]["metadata"]["labels"])
        (rule,) = redis_policy["spec"]["ingress"]
        assert [p["port"] for p in rule["ports"]] == [6379]
        (peer,) = rule["from"]
        assert selects(peer["podSelector"], pods["head"]["metadata"]["labels"])
        assert not selects(peer["podSelector"], other_release(pods["head"]["metadata"]["labels"]))


def test_redis_is_deployed_or_external(rendered: Rendered) -> None:
    redis = rendered.values["redis"]
    url = rendered.application["args"]["redis_url"]
    if redis["externalUrl"]:
        assert url == redis["externalUrl"]
        assert not rendered.of_kind("Deployment")
        assert not [s for s in rendered.of_kind("Service") if s["metadata"]["name"].endswith(
            "-redis")]
        return
    service = rendered.one("Service", "-redis")
    assert url == f"redis://{service['metadata']['name']}.{NAMESPACE}.svc:6379/0"
    assert [p["port"] for p in service["spec"]["ports"]] == [6379]
    pod = rendered.pod_templates()["redis"]
    assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])


def test_the_ray_head_keeps_its_state_in_redis(rendered: Rendered) -> None:
    """GCS fault tolerance: KubeRay's gcsFaultToleranceOptions name a Redis the head reaches."""
    ft = rendered.values["rayService"]["gcsFaultTolerance"]
    options = rendered.cluster.get("gcsFaultToleranceOptions")
    if not ft["enabled"]:
        assert options is None
        return
    assert options is not None
    if ft["redisAddress"]:
        assert options["redisAddress"] == ft["redisAddress"]
    else:  # the release's Redis: its Service, which admits the head's pod
        service = rendered.one("Service", "-redis")
        assert options["redisAddress"] == f"{service['metadata']['name']}.{NAMESPACE}.svc:6379"
        policies = [p for p in rendered.of_kind("NetworkPolicy")
                    if p["metadata"]["name"].endswith("-redis")]
        head = rendered.pod_templates()["head"]
        assert all(any(selects(source["podSelector"], head["metadata"]["labels"])
                       for rule in policy["spec"]["ingress"] for source in rule["from"])
                   for policy in policies)
    secret = ft["redisPasswordSecret"]
    if secret["name"]:
        assert options["redisPassword"] == {"valueFrom": {"secretKeyRef": secret}}
    else:
        assert "redisPassword" not in options


@pytest.mark.parametrize(("settings", "address"), [
    (("redis.enabled=false", "redis.externalUrl=redis://index.example.internal/0"),
     "index.example.internal:6379"),
    (("redis.enabled=false", "redis.externalUrl=redis://index.example.internal:6380/2"),
     "index.example.internal:6380"),
    (("rayService.gcsFaultTolerance.redisAddress=gcs.example.internal:7000",),
     "gcs.example.internal:7000"),
    (("rayService.gcsFaultTolerance.enabled=false",), None),
])
def test_the_head_redis_follows_the_values(helm: Helm, settings: tuple[str, ...],
                                           address: str | None) -> None:
    args = [a for s in settings for a in ("--set", s)]
    objects = helm.template(*SKIP_KUBERAY_CHECK, *args)
    (service,) = [o for o in objects if o["kind"] == "RayService"]
    options = service["spec"]["rayClusterConfig"].get("gcsFaultToleranceOptions")
    assert (options and options["redisAddress"]) == address


def _group_pods(rendered: Rendered, component: str) -> int:
    if component == "head":
        return 1
    values = rendered.values[component]
    return int(values["replicas"]) if component == "gateway" else initial_replicas(values)


def test_disruption_budgets_keep_engines_and_gateways_up(rendered: Rendered) -> None:
    pods = rendered.pod_templates()
    budgets = rendered.of_kind("PodDisruptionBudget")
    for budget in budgets:
        matched = [c for c, t in pods.items()
                   if selects(budget["spec"]["selector"], t["metadata"]["labels"])]
        assert len(matched) == 1, (budget["metadata"]["name"], matched)
        (component,) = matched
        pods_in_group = _group_pods(rendered, component)
        assert 0 < budget["spec"]["minAvailable"] <= pods_in_group
        if component != "head":
            assert pods_in_group - budget["spec"]["minAvailable"] == (
                rendered.values[component]["podDisruptionBudget"]["maxUnavailable"])
    covered = {c for b in budgets for c, t in pods.items()
               if selects(b["spec"]["selector"], t["metadata"]["labels"])}
    for role in ("gateway", *ROLES):
        budget = rendered.values[role]["podDisruptionBudget"]
        wanted = budget["enabled"] and _group_pods(rendered, role) > budget["maxUnavailable"]
        assert (role in covered) is wanted, role


def test_ingress_routes_to_the_http_service(helm: Helm) -> None:
    rendered = Rendered("small", values_for("small-1p1d-values"),
                        helm.template(*render_args("small-1p1d-values")))
    ingress = rendered.one("Ingress")
    http_service = rendered.one("Service", "-http")["metadata"]["name"]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "tandem.internal.example"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": http_service, "port": {"name": "http"}}
    assert ingress["spec"]["tls"][0]["secretName"] == "tandem-tls"
    assert not rendered_default_has("Ingress", helm)


def rendered_default_has(kind: str, helm: Helm) -> bool:
    return any(o["kind"] == kind for o in helm.template(*render_args("default")))


# ----------------------------------------------------------------- monitoring


def _rule_files_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = []
    for path in sorted((CHART_DIR / "rules").glob("*.yaml")):
        groups.extend(yaml.safe_load(path.read_text())["groups"])
    return groups


def test_service_monitor_scrapes_the_gateway_metrics(helm: Helm) -> None:
    rendered = Rendered("default", values_for("default"), helm.template(*render_args("default")))
    monitor = rendered.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    scraped = [s for s in rendered.of_kind("Service")
               if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in scraped] == [f"{RELEASE}-http"]
    assert endpoint["port"] in {p["name"] for p in scraped[0]["spec"]["ports"]}


def test_prometheus_rule_carries_every_rule_file(helm: Helm) -> None:
    rule = next(o for o in helm.template(*render_args("default"))
                if o["kind"] == "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    groups = rule["spec"]["groups"]
    assert groups == _rule_files_groups() and groups
    for group in groups:
        assert group["name"] and group["rules"]
        for entry in group["rules"]:
            assert entry["expr"]
            assert ("record" in entry) != ("alert" in entry), entry


@pytest.mark.parametrize(("args", "present"), [
    ((), False),  # no Prometheus operator in the cluster: nothing it cannot take
    (("--api-versions", "monitoring.coreos.com/v1"), True),
    (("--set", "monitoring.forcePrometheusOperator=true"), True),
    (("--set", "monitoring.forcePrometheusOperator=true",
      "--set", "monitoring.serviceMonitor.enabled=false",
      "--set", "monitoring.prometheusRule.enabled=false"), False),
])
def test_prometheus_operator_objects_need_its_api(helm: Helm, args: tuple[str, ...],
                                                  present: bool) -> None:
    kinds = {o["kind"] for o in helm.template(*SKIP_KUBERAY_CHECK, *args)}
    assert ("ServiceMonitor" in kinds) is present
    assert ("PrometheusRule" in kinds) is present


@pytest.mark.parametrize("name", ["default", "external-redis-values"])
def test_dashboards_ship_as_sidecar_config_maps(helm: Helm, name: str) -> None:
    settings = values_for(name)["monitoring"]["dashboards"]
    maps = [o for o in helm.template(*render_args(name)) if o["kind"] == "ConfigMap"
            and o["metadata"]["labels"].get("app.kubernetes.io/component") == "dashboards"]
    files = sorted((CHART_DIR / "dashboards").glob("*.json"))
    assert files and len(maps) == len(files)
    shipped = {}
    for config_map in maps:
        assert config_map["metadata"]["labels"][settings["label"]] == settings["labelValue"]
        (key,) = config_map["data"]
        shipped[key] = json.loads(config_map["data"][key])
    assert shipped == {p.name: json.loads(p.read_text()) for p in files}


# ------------------------------------------------------------- broken values


@pytest.mark.parametrize(("setting", "message"), [
    ("prefill.replicas=-1", "at '/prefill/replicas': minimum: got -1, want 1"),
    ("decode.replicas=0", "at '/decode/replicas': minimum: got 0, want 1"),
    ("decode.replicaz=3", "at '/decode': additional properties 'replicaz' not allowed"),
    ("app.max_num_seqs=0", "at '/app/max_num_seqs': minimum: got 0, want 1"),
    ("app.tensor_parallel=2", "at '/app': additional properties 'tensor_parallel' not allowed"),
    ("prefill.gpusPerReplica=-2", "at '/prefill/gpusPerReplica': minimum: got -2, want 0"),
])
@pytest.mark.parametrize("command", ["template", "lint"])
def test_broken_values_fail_with_the_schema_message(helm: Helm, command: str, setting: str,
                                                    message: str) -> None:
    args = ("template", RELEASE) if command == "template" else ("lint", "--strict")
    result = helm.run(*args, str(CHART_DIR), *SKIP_KUBERAY_CHECK, "--set", setting)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


@pytest.mark.parametrize(("settings", "message"), [
    (("prefill.autoscaling.enabled=true", "prefill.autoscaling.minReplicas=5",
      "prefill.autoscaling.maxReplicas=2"),
     "prefill.autoscaling: minReplicas (5) must not exceed maxReplicas (2)"),
    (("redis.externalUrl=redis://elsewhere:6379",),
     "set either redis.enabled=true (a Redis in this release) or redis.externalUrl, not both"),
    (("model.path=llama",), "model.volume: set a volume source holding model.path"),
    (("redis.enabled=false", "redis.externalUrl=rediss://index.example.internal:6380/0"),
     "rayService.gcsFaultTolerance: the Ray head's Redis cannot be taken from redis.externalUrl "
     "(rediss://...: Ray's GCS takes a plain host:port, with the password from a Secret)"),
    (("redis.enabled=false", "redis.externalUrl=redis://:secret@index.example.internal/0"),
     "the Ray head's Redis cannot be taken from redis.externalUrl (redis://..."),
    (("redis.enabled=false",),
     "rayService.gcsFaultTolerance: no Redis to keep the Ray head's state in; set "
     "redis.enabled=true, rayService.gcsFaultTolerance.redisAddress, or "
     "rayService.gcsFaultTolerance.enabled=false"),
    (("gateway.replicas=1", "redis.enabled=false", "rayService.gcsFaultTolerance.enabled=false"),
     "gateway.replicas: gateways beside the head need a Redis (redis.enabled or "
     "redis.externalUrl)"),
    (("app.tensor_parallel_size=2",),
     "app.tensor_parallel_size 2: engines size the KV cache from gpu_memory_utilization with "
     "one rank only; set app.kv_cache_memory_gb (GiB per rank)"),
])
def test_inconsistent_values_fail_clearly(helm: Helm, settings: tuple[str, ...],
                                          message: str) -> None:
    args = [a for s in settings for a in ("--set", s)]
    with pytest.raises(HelmError, match=re.escape(message)):
        helm.template(*SKIP_KUBERAY_CHECK, *args)


def test_missing_kuberay_fails_with_a_clear_message(helm: Helm) -> None:
    result = helm.run("template", RELEASE, str(CHART_DIR))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Tandem needs the KubeRay operator" in output
    assert "does not serve the ray.io/v1 RayService API" in output
    assert "helm install kuberay-operator" in output
    # With the API served, the same values install.
    assert helm.template("--api-versions", "ray.io/v1/RayService")


# ------------------------------------------------- the chart and the code agree


def test_values_schema_tracks_appconfig() -> None:
    from tandem.router.config import POLICIES
    from tandem.services.engine.config import ATTENTION_BACKENDS, SPEC_METHODS
    from tandem.services.kv_transfer.factory import TRANSPORTS
    from tandem.services.serving.config import DTYPES

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    app = schema["properties"]["app"]
    assert app["additionalProperties"] is False
    settings = {f.name for f in fields(AppConfig)}
    assert not set(app["properties"]) & (CHART_OWNED | AUTH_OWNED)
    settings -= AUTH_OWNED  # the chart sets these from `auth:`
    missing = settings - CHART_OWNED - set(app["properties"])
    assert not missing, (f"AppConfig settings the chart cannot set: {sorted(missing)}; add them "
                         "to app.properties in deploy/helm/tandem/values.schema.json")
    assert set(app["properties"]) | CHART_OWNED == settings
    enums = {"dtype": DTYPES, "kv_transport": TRANSPORTS, "routing_policy": POLICIES,
             "spec": SPEC_METHODS, "attention_backend": ATTENTION_BACKENDS}
    for name, choices in enums.items():
        assert app["properties"][name]["enum"] == list(choices), name


def test_values_schema_is_strict_at_every_level() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())

    def walk(node: dict[str, Any], where: str) -> None:
        if "properties" in node:
            assert node.get("additionalProperties") is False, where
            for key, child in node["properties"].items():
                walk(child, f"{where}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{where}[]")

    walk(schema, "values")
    for role in ROLES:
        role_schema = schema["properties"][role]["properties"]
        assert role_schema["replicas"]["minimum"] == 1
        for bound in ("minReplicas", "maxReplicas"):
            assert role_schema["autoscaling"]["properties"][bound]["minimum"] == 1


def test_image_matches_the_chart_and_ci_pins() -> None:
    import ray

    dockerfile = (REPO_ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    setup = (REPO_ROOT / ".ci" / "setup").read_text()
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    pins = {"TORCH_VERSION": re.search(r"torch==(\S+)", setup),  # CI's torch, the image's
            "NIXL_VERSION": re.search(r"nixl-cu12==(\S+)", " ".join(extras["cpu"]))}
    for arg, ci in pins.items():
        pinned = re.search(rf"^ARG {arg}=(\S+)$", dockerfile, re.M)
        assert pinned and ci and pinned.group(1) == ci.group(1).strip('"'), arg
    assert f"nixl-cu13=={pins['NIXL_VERSION'].group(1)}" in extras["gpu"]
    # The image's NIXL is built for torch's CUDA (13); CI's (cu12) moves host memory only.
    assert '"nixl-cu13==${NIXL_VERSION}"' in dockerfile
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["rayVersion"] == ray.__version__
    user = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert user == [(str(values["podSecurityContext"]["runAsUser"]),
                     str(values["podSecurityContext"]["runAsGroup"]))]


def test_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    dockerfile = REPO_ROOT / "deploy" / "docker" / "Dockerfile"
    result = subprocess.run([str(hadolint), "--no-color", "--failure-threshold", "info",
                             str(dockerfile)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_wildcard_worker_host_becomes_a_reachable_address() -> None:
    """The chart gives workers worker_host 0.0.0.0: each must listen on and advertise an
    address its peers on other pods can dial, not the wildcard."""
    from tandem.services.serving.workers import reachable_host

    for wildcard in WILDCARDS:
        host = reachable_host(wildcard)
        assert host not in WILDCARDS
        address = ipaddress.ip_address(host)
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    assert reachable_host("127.0.0.1") == "127.0.0.1"
