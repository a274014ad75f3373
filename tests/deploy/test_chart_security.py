"""The chart's security settings (issue 18, chart side), rendered with the real helm.

What the NetworkPolicies admit (no any-source rule on a worker port or the Ray dashboard, any
source on HTTP/gRPC only with networkPolicy.allowAnySource), the API-key, cluster and Ray-token
Secrets and their wiring into the pods and the serve config, Ray's token authentication (KubeRay
authOptions, the token read from a mounted file), TLS on the front ends, and the refusals: a
LoadBalancer without keys, a /metrics behind keys that Prometheus is given no key for, HTTPS
that Prometheus is not told how to check.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import CHART_DIR, NAMESPACE, RELEASE, SHARED_SCHEMAS, Helm, HelmError
from tests.deploy.test_helm_chart import (
    K8S_VERSIONS,
    ROLES,
    SKIP_KUBERAY_CHECK,
    VALUE_SETS,
    Rendered,
    _deep_merge,
    _strict,
    other_release,
    render_args,
    selects,
    values_for,
)

DASHBOARD = 8265
MOUNT = "/etc/tandem/secrets"
GATEWAY_PODS = ("head", "gateway")  # the groups whose pods run a gateway replica
NAME_LABEL = "kubernetes.io/metadata.name"
MONITOR = ("--set", "monitoring.forcePrometheusOperator=true")
# Made-up keys for the chart to put in a Secret: test data, not secrets.
TENANTS = {"team-a": ["test-key-team-a-0001", "test-key-team-a-0002"],
           "team-b": ["test-key-team-b-0001"]}


def render(helm: Helm, overrides: dict[str, Any], base: str = "default") -> Rendered:
    """A value set with `overrides` on top, given as a values file."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as values:
        values.write(yaml.safe_dump(overrides))
        values.flush()
        objects = helm.template(*render_args(base), "-f", values.name)
    return Rendered(base, _deep_merge(values_for(base), overrides), objects)


# ------------------------------------------------------------ what the policies admit


def _empty(selector: dict[str, Any] | None) -> bool:
    return not (selector or {}).get("matchLabels") and not (selector or {}).get(
        "matchExpressions")


def peer_admits_any_source(peer: dict[str, Any]) -> bool:
    """Every pod of every namespace (or every address) matches this NetworkPolicyPeer."""
    if "ipBlock" in peer:
        return ipaddress.ip_network(peer["ipBlock"]["cidr"], strict=False).prefixlen == 0
    return "namespaceSelector" in peer and _empty(peer["namespaceSelector"]) and _empty(
        peer.get("podSelector"))


def rule_admits_any_source(rule: dict[str, Any]) -> bool:
    peers = rule.get("from") or []
    return not peers or any(peer_admits_any_source(p) for p in peers)


def rule_ports(rule: dict[str, Any]) -> set[int] | None:
    """The ports a rule opens; None: every port."""
    ports = rule.get("ports") or []
    return {p["port"] for p in ports} if ports else None


def any_source_violations(rendered: Rendered) -> list[str]:
    """Every any-source rule that is not allowed: one covering a worker port or the dashboard
    (no rule `ports`: every port), or HTTP/gRPC without networkPolicy.allowAnySource."""
    values = rendered.values
    public = {values["ports"]["http"], values["ports"]["grpc"]}
    found = []
    for policy in rendered.of_kind("NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            if not rule_admits_any_source(rule):
                continue
            ports = rule_ports(rule)
            where = f"{policy['metadata']['name']}: {rule}"
            if ports is None or not ports <= public:
                found.append(f"any source on worker ports or the dashboard: {where}")
            elif not values["networkPolicy"]["allowAnySource"]:
                found.append(f"any source on HTTP/gRPC without allowAnySource: {where}")
    return found


def dashboard_violations(rendered: Rendered) -> list[str]:
    """Rules that reach 8265 other than the operator's (its namespace by the API server's
    kubernetes.io/metadata.name and its pods' labels) and this release's own pods."""
    np = rendered.values["networkPolicy"]
    found = []
    pods = rendered.pod_templates()
    for policy in rendered.of_kind("NetworkPolicy"):
        if not selects(policy["spec"]["podSelector"], pods["head"]["metadata"]["labels"]):
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = rule_ports(rule)
            if ports is not None and DASHBOARD not in ports:
                continue
            for peer in rule.get("from") or [{}]:
                if set(peer) == {"podSelector"} and ports is None:
                    # Same namespace: only this release's pods.
                    labels = pods["head"]["metadata"]["labels"]
                    if (not _empty(peer["podSelector"]) and selects(peer["podSelector"], labels)
                            and not selects(peer["podSelector"], other_release(labels))):
                        continue
                namespace = (peer.get("namespaceSelector") or {}).get("matchLabels", {})
                pod = peer.get("podSelector") or {}
                if (ports == {DASHBOARD} and np["dashboard"]
                        and namespace == {NAME_LABEL: np["operatorNamespace"]}
                        and not peer.get("ipBlock")
                        and pod.get("matchLabels") == np["operatorPodLabels"]
                        and not _empty(pod)):
                    continue
                found.append(f"{policy['metadata']['name']}: 8265 reachable from {peer}")
    return found


NETWORK_CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "any source": {"networkPolicy": {"allowAnySource": True}},
    "no dashboard": {"networkPolicy": {"dashboard": False}},
    "no ingress, no prometheus": {"networkPolicy": {"ingressNamespace": "",
                                                    "prometheusFrom": []}},
    "other namespaces": {"networkPolicy": {
        "ingressNamespace": "traefik", "operatorNamespace": "ray-system",
        "operatorPodLabels": {"app.kubernetes.io/name": "kuberay", "team": "platform"},
        "prometheusFrom": [{"namespaceSelector": {"matchLabels": {NAME_LABEL: "obs"}},
                            "podSelector": {"matchLabels": {"app": "prometheus"}}}]}},
    "extra clients": {"networkPolicy": {
        "httpFrom": [{"podSelector": {"matchLabels": {"tandem-client": "true"}}}],
        "grpcFrom": [{"ipBlock": {"cidr": "10.20.0.0/16"}}]}},
}


@pytest.fixture(scope="module", params=[*NETWORK_CASES, *(f"ci:{n}" for n in VALUE_SETS)])
def policies(request: pytest.FixtureRequest, helm: Helm) -> Rendered:
    name: str = request.param
    if name.startswith("ci:"):
        base = name[3:]
        return Rendered(base, values_for(base), helm.template(*render_args(base)))
    return render(helm, NETWORK_CASES[name])


def test_no_any_source_rule_but_the_opted_in_front_ends(policies: Rendered) -> None:
    values = policies.values
    if not values["networkPolicy"]["enabled"]:
        assert not policies.of_kind("NetworkPolicy")
        return
    assert not any_source_violations(policies)
    ray = policies.one("NetworkPolicy", "-ray")
    any_ports = {port for rule in ray["spec"]["ingress"] if rule_admits_any_source(rule)
                 for port in rule_ports(rule) or {0}}
    if values["networkPolicy"]["allowAnySource"]:
        assert any_ports == {values["ports"]["http"], values["ports"]["grpc"]}
    else:
        assert not any_ports


def test_dashboard_only_for_the_operator_namespace(policies: Rendered) -> None:
    np = policies.values["networkPolicy"]
    if not np["enabled"]:
        return
    assert not dashboard_violations(policies)
    ray = policies.one("NetworkPolicy", "-ray")
    named = [r for r in ray["spec"]["ingress"] if rule_ports(r) == {DASHBOARD}]
    if not np["dashboard"]:
        assert not named
        return
    ((rule,),) = [named]
    ((peer,),) = [rule["from"]]
    assert peer["namespaceSelector"] == {"matchLabels": {NAME_LABEL: np["operatorNamespace"]}}
    operator_pod = {"app.kubernetes.io/name": "kuberay-operator", **np["operatorPodLabels"]}
    assert selects(peer["podSelector"], operator_pod)
    assert not selects(peer["podSelector"], {"app.kubernetes.io/name": "something-else"})


def test_front_ends_open_to_the_ingress_namespace_and_prometheus(helm: Helm) -> None:
    rendered = render(helm, {})
    ray = rendered.one("NetworkPolicy", "-ray")
    by_port = {p: r["from"] for r in ray["spec"]["ingress"] for p in (rule_ports(r) or ())}
    ingress = {"namespaceSelector": {"matchLabels": {NAME_LABEL: "ingress-nginx"}}}
    prometheus = {"namespaceSelector": {"matchLabels": {NAME_LABEL: "monitoring"}}}
    assert by_port[8000] == [ingress, prometheus]
    assert by_port[50051] == [ingress]
    # Nothing to admit: no rule at all (a rule without `from` would admit everyone).
    closed = render(helm, NETWORK_CASES["no ingress, no prometheus"])
    ray = closed.one("NetworkPolicy", "-ray")
    assert all(rule_ports(r) in (None, {DASHBOARD}) for r in ray["spec"]["ingress"])


def test_the_checks_catch_the_old_open_policy(helm: Helm) -> None:
    """The checks above fail on what the chart rendered before: HTTP/gRPC rules without `from`
    and the dashboard open to any namespace's pods with the operator's label."""
    rendered = render(helm, {})
    ray = rendered.one("NetworkPolicy", "-ray")
    for rule in ray["spec"]["ingress"]:
        ports = rule_ports(rule)
        if ports in ({8000}, {50051}):
            rule.pop("from")
        if ports == {DASHBOARD}:
            rule["from"][0]["namespaceSelector"] = {}
    assert len(any_source_violations(rendered)) == 2
    assert len(dashboard_violations(rendered)) == 1
    ray["spec"]["ingress"].append({"from": [{"namespaceSelector": {}}]})
    assert "worker ports" in any_source_violations(rendered)[-1]
    assert len(dashboard_violations(rendered)) == 2


@pytest.mark.parametrize("peer", [
    {"namespaceSelector": {}},
    {"namespaceSelector": {"matchLabels": {}}, "podSelector": {}},
    {"ipBlock": {"cidr": "0.0.0.0/0"}},
    {"ipBlock": {"cidr": "::/0"}},
])
@pytest.mark.parametrize("setting", ["httpFrom", "grpcFrom", "prometheusFrom"])
def test_any_source_peers_are_refused(helm: Helm, setting: str, peer: dict[str, Any]) -> None:
    with pytest.raises(HelmError, match=re.escape(
            f"networkPolicy.{setting}: {json.dumps(peer, separators=(',', ':'))} admits any "
            "source; set networkPolicy.allowAnySource=true")):
        render(helm, {"networkPolicy": {setting: [peer]}})


# ---------------------------------------------------------------------- the Secrets


def secrets_volume(rendered: Rendered,
                   component: str) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """The pod's secrets volume and {file: (Secret name, key)} it projects."""
    spec = rendered.group(component)["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "secrets"]
    files = {}
    for source in volume["projected"]["sources"]:
        for item in source["secret"]["items"]:
            assert item["path"] not in files, item
            files[item["path"]] = (source["secret"]["name"], item["key"])
    return volume, files


def mounted_file(rendered: Rendered, component: str, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in the component's Ray container: through a
    volume mount and the Secret projected there. Fails if no mounted Secret holds that file."""
    spec = rendered.group(component)["template"]["spec"]
    (container,) = spec["containers"]
    for mount in container["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix):
            continue
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        for source in volume.get("projected", {}).get("sources", []):
            for item in source.get("secret", {}).get("items", []):
                if item["path"] == path[len(prefix):]:
                    return source["secret"]["name"], item["key"]
    raise AssertionError(f"{component}: no mounted Secret holds {path}")


def ray_env(rendered: Rendered, component: str) -> dict[str, dict[str, Any]]:
    """The Ray container's env by name (each name once)."""
    (container,) = rendered.group(component)["template"]["spec"]["containers"]
    env = container.get("env", [])
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), f"{component}: duplicate env {names}"
    return {e["name"]: e for e in env}


SECRET_CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "existing keys": {"auth": {"apiKeys": {"existingSecret": "my-keys"}}},
    "created keys": {"auth": {"apiKeys": {"create": {"tenants": TENANTS}}},
                     "gateway": {"replicas": 1}},
    "existing cluster secret": {"auth": {"clusterSecret": {"existingSecret": "my-cluster"}}},
    "metrics behind keys": {
        "auth": {"apiKeys": {"existingSecret": "my-keys"}, "metricsRequireKey": True},
        "monitoring": {"serviceMonitor": {"bearerTokenSecret": {"name": "prom-key",
                                                                 "key": "token"}}}},
    "existing ray token": {"auth": {"rayToken": {"existingSecret": "my-ray-token"}}},
    "no ray token": {"auth": {"rayToken": {"enabled": False}}},
    "no ray token, keys": {"auth": {"rayToken": {"enabled": False},
                                    "apiKeys": {"existingSecret": "my-keys"}}},
    "tls": {"tls": {"existingSecret": "my-tls"},
            "monitoring": {"serviceMonitor": {"tlsConfig": {"insecureSkipVerify": True}}}},
}


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    """KubeRay's RayService schema, unknown fields rejected (as test_helm_chart checks it)."""
    crd = yaml.safe_load((SHARED_SCHEMAS / "kuberay" / "ray.io_rayservices.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(v1["schema"]["openAPIV3Schema"])


def assert_valid(rendered: Rendered, crd_schema: dict[str, Any]) -> None:
    """Every object valid Kubernetes; the RayService valid against KubeRay's CRD."""
    for version in K8S_VERSIONS:
        for obj in rendered.objects:
            if obj["kind"] in {"RayService", "ServiceMonitor", "PrometheusRule"}:
                continue
            kubernetes_validate.validate(obj, version, strict=True)
    errors = list(jsonschema.Draft7Validator(crd_schema).iter_errors(rendered.ray_service))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize("case", list(SECRET_CASES))
def test_secrets_are_wired_into_the_pods_and_the_serve_config(
        helm: Helm, crd_schema: dict[str, Any], case: str) -> None:
    overrides = SECRET_CASES[case]
    rendered = render(helm, overrides)
    auth = rendered.values["auth"]
    fullname = rendered.ray_service["metadata"]["name"]
    secrets = {s["metadata"]["name"]: s for s in rendered.of_kind("Secret")}

    # Every rendered object is still valid Kubernetes, the Secrets included, and the
    # RayService (authOptions included) valid KubeRay.
    assert_valid(rendered, crd_schema)
    for secret in secrets.values():
        assert (secret["apiVersion"], secret["type"]) == ("v1", "Opaque")

    keys_secret = auth["apiKeys"]["existingSecret"] or (
        f"{fullname}-api-keys" if auth["apiKeys"]["create"]["tenants"] else None)
    cluster_secret = auth["clusterSecret"]["existingSecret"] or f"{fullname}-cluster-secret"
    ray_secret = (auth["rayToken"]["existingSecret"] or f"{fullname}-ray-token"
                  if auth["rayToken"]["enabled"] else None)
    tls_secret = rendered.values["tls"]["existingSecret"] or None
    created = {n for n in (keys_secret, cluster_secret, ray_secret)
               if n and n.startswith(fullname)}
    assert set(secrets) == created

    if f"{fullname}-api-keys" in secrets:
        text = base64.b64decode(secrets[f"{fullname}-api-keys"]["data"]["api-keys"]).decode()
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
        assert lines == [f"{t}:{k}" for t, keys in TENANTS.items() for k in keys]
    if f"{fullname}-cluster-secret" in secrets:
        value = base64.b64decode(secrets[f"{fullname}-cluster-secret"]["data"]["cluster-secret"])
        assert re.fullmatch(rb"[A-Za-z0-9]{48}", value)
    if f"{fullname}-ray-token" in secrets:
        # KubeRay reads the token under this key (and sends it as it is: no newline).
        (key,) = secrets[f"{fullname}-ray-token"]["data"]
        assert key == "auth_token"
        value = base64.b64decode(secrets[f"{fullname}-ray-token"]["data"]["auth_token"])
        assert re.fullmatch(rb"[A-Za-z0-9]{48}", value)

    # Mounted read-only, readable by the pod's group only: every pod gets the cluster secret
    # and Ray's token, the gateways' (the head, the gateway pods) the API keys and the TLS
    # files as well.
    for component in rendered.ray_groups():
        spec = rendered.group(component)["template"]["spec"]
        volume, files = secrets_volume(rendered, component)
        assert volume["projected"]["defaultMode"] == 0o440
        assert spec["securityContext"]["fsGroup"]
        expected = {"cluster-secret": (cluster_secret, "cluster-secret")}
        if ray_secret:
            expected["ray-auth-token"] = (ray_secret, "auth_token")
        if component in GATEWAY_PODS and keys_secret:
            expected["api-keys"] = (keys_secret, "api-keys")
        if component in GATEWAY_PODS and tls_secret:
            expected["tls.crt"] = (tls_secret, "tls.crt")
            expected["tls.key"] = (tls_secret, "tls.key")
        assert files == expected, component
        (container,) = spec["containers"]
        mounts = [m for m in container["volumeMounts"] if m["name"] == "secrets"]
        assert mounts == [{"name": "secrets", "mountPath": MOUNT, "readOnly": True}]

    # The serve config names the files, and each is the right Secret's key, in every pod that
    # reads it: the cluster secret everywhere (workers authenticate each other with it, with
    # or without API keys), the rest on the head.
    args = rendered.application["args"]
    assert args["cluster_secret_file"] == f"{MOUNT}/cluster-secret"
    for component in rendered.ray_groups():
        assert mounted_file(rendered, component, args["cluster_secret_file"]) == (
            cluster_secret, "cluster-secret")
    assert args.get("api_keys_file") == (f"{MOUNT}/api-keys" if keys_secret else None)
    if keys_secret:
        for component in set(GATEWAY_PODS) & set(rendered.ray_groups()):
            assert mounted_file(rendered, component, args["api_keys_file"]) == (
                keys_secret, "api-keys")
    assert args.get("metrics_require_key") == (True if auth["metricsRequireKey"] else None)


def test_service_monitor_sends_a_key_when_metrics_need_one(helm: Helm) -> None:
    for case, authorization in (("existing keys", None), ("metrics behind keys", {
            "type": "Bearer", "credentials": {"name": "prom-key", "key": "token"}})):
        rendered = render(helm, SECRET_CASES[case])
        (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
        assert endpoint.get("authorization") == authorization, case
        assert "bearerTokenSecret" not in endpoint  # deprecated in the Prometheus operator


def test_cluster_secret_is_random_where_it_cannot_be_looked_up(helm: Helm) -> None:
    """`helm template` has no cluster to look the Secret up in: each run makes a new value
    (install and upgrade keep the one in the cluster; documented in values.yaml)."""
    values = {render(helm, {}).one("Secret", "-cluster-secret")["data"]["cluster-secret"]
              for _ in range(2)}
    assert len(values) == 2


def test_secret_mount_path_follows_the_value(helm: Helm) -> None:
    rendered = render(helm, {"auth": {"secretsMountPath": "/run/tandem",
                                      "apiKeys": {"existingSecret": "k"}}})
    args = rendered.application["args"]
    assert (args["api_keys_file"], args["cluster_secret_file"]) == (
        "/run/tandem/api-keys", "/run/tandem/cluster-secret")


# ------------------------------------------------------------------ Ray's own token

RAY_AUTH_ENV = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}


def check_ray_token_auth(rendered: Rendered) -> str:
    """Token authentication on every Ray container, the token only in a mounted file; returns
    the Secret holding it. KubeRay's authOptions names the same Secret."""
    options = rendered.cluster["authOptions"]
    assert options["mode"] == "token"
    secret = options["secretName"]
    for component in rendered.ray_groups():
        env = ray_env(rendered, component)
        assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}, component
        path = env["RAY_AUTH_TOKEN_PATH"]["value"]
        assert set(env["RAY_AUTH_TOKEN_PATH"]) == {"name", "value"}
        # The file is the key KubeRay reads, from the Secret authOptions names, in this pod.
        assert mounted_file(rendered, component, path) == (secret, "auth_token"), component
        # Present and empty: KubeRay then adds no RAY_AUTH_TOKEN of its own (the token in the
        # environment), and Ray, skipping an empty one, reads the file.
        assert env["RAY_AUTH_TOKEN"] == {"name": "RAY_AUTH_TOKEN", "value": ""}, component
    return secret


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def value_set(request: pytest.FixtureRequest, helm: Helm) -> Rendered:
    name = request.param
    return Rendered(name, values_for(name), helm.template(*render_args(name)))


def test_ray_token_authentication_is_on_by_default(value_set: Rendered) -> None:
    assert value_set.values["auth"]["rayToken"]["enabled"]
    secret = check_ray_token_auth(value_set)
    assert secret == value_set.values["auth"]["rayToken"]["existingSecret"] or (
        secret == f"{RELEASE}-ray-token" and value_set.one("Secret", "-ray-token"))


def test_ray_token_is_nowhere_but_in_its_secret(helm: Helm) -> None:
    rendered = render(helm, {"auth": {"apiKeys": {"create": {"tenants": TENANTS}}}})
    secret = rendered.one("Secret", "-ray-token")
    encoded = secret["data"]["auth_token"]
    token = base64.b64decode(encoded).decode()
    cluster = rendered.one("Secret", "-cluster-secret")["data"]["cluster-secret"]
    assert token != base64.b64decode(cluster).decode()
    # Not in any other object (env, the serve config, annotations), plain or encoded.
    for obj in rendered.objects:
        if obj is secret:
            continue
        text = yaml.safe_dump(obj)
        assert token not in text and encoded not in text, obj["metadata"]["name"]
    # No Ray container takes the token from the environment, literally or by reference.
    for component in rendered.ray_groups():
        env = ray_env(rendered, component)
        assert all("valueFrom" not in e for n, e in env.items() if n in RAY_AUTH_ENV)
        assert token not in {e.get("value") for e in env.values()}
    check_ray_token_auth(rendered)
    # The check above fails on a token handed over in the environment.
    (container,) = rendered.group("decode")["template"]["spec"]["containers"]
    for entry in container["env"]:
        if entry["name"] == "RAY_AUTH_TOKEN":
            entry["value"] = token
    with pytest.raises(AssertionError):
        check_ray_token_auth(rendered)


def test_ray_token_from_an_existing_secret(helm: Helm, crd_schema: dict[str, Any]) -> None:
    rendered = render(helm, {"auth": {"rayToken": {"existingSecret": "my-ray-token"}}})
    assert_valid(rendered, crd_schema)
    assert check_ray_token_auth(rendered) == "my-ray-token"
    assert rendered.cluster["authOptions"] == {"mode": "token", "secretName": "my-ray-token"}
    assert not [s for s in rendered.of_kind("Secret") if s["metadata"]["name"].endswith(
        "-ray-token")]


def test_ray_token_authentication_can_be_turned_off(helm: Helm,
                                                    crd_schema: dict[str, Any]) -> None:
    rendered = render(helm, {"auth": {"rayToken": {"enabled": False}},
                             "extraEnv": [{"name": "OTEL_SERVICE_NAME", "value": "tandem"}]})
    assert_valid(rendered, crd_schema)
    assert "authOptions" not in rendered.cluster
    for component in rendered.ray_groups():
        assert not RAY_AUTH_ENV & set(ray_env(rendered, component)), component
        assert "ray-auth-token" not in secrets_volume(rendered, component)[1]
        assert "OTEL_SERVICE_NAME" in ray_env(rendered, component)
    with pytest.raises(KeyError):
        check_ray_token_auth(rendered)
    # Off, an older Ray is fine (on, it is refused: test_bad_auth_values_fail_clearly).
    old_ray = render(helm, {"auth": {"rayToken": {"enabled": False}}, "rayVersion": "2.51.1"})
    assert "authOptions" not in old_ray.cluster
    # And the user's env still comes after the chart's with it on.
    on = render(helm, {"head": {"extraEnv": [{"name": "OTEL_SERVICE_NAME", "value": "h"}]}})
    assert list(ray_env(on, "head")) == ["RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH",
                                         "RAY_AUTH_TOKEN", "OTEL_SERVICE_NAME"]


def test_ray_token_is_random_where_it_cannot_be_looked_up(helm: Helm) -> None:
    values = {render(helm, {}).one("Secret", "-ray-token")["data"]["auth_token"]
              for _ in range(2)}
    assert len(values) == 2


def test_probes_are_left_open_by_rays_token_authentication() -> None:
    """The worker probe (and KubeRay's default head probes) ask the raylet's and the GCS's
    health endpoints, which Ray's token authentication leaves open: the probes need no
    token. (preStop's `ray drain-node` reads RAY_AUTH_TOKEN_PATH like Ray itself.)"""
    import ray.dashboard.http_server_head
    from ray.dashboard.http_server_agent import PUBLIC_EXACT_PATHS

    assert "/api/local_raylet_healthz" in PUBLIC_EXACT_PATHS
    # The head's list is a local of its start-up method: read from the source.
    head_server = Path(ray.dashboard.http_server_head.__file__).read_text()
    public = re.search(r"public_exact_paths = \{(.*?)\}", head_server, re.S)
    assert public, "the dashboard head's public paths moved"
    for path in ("/api/gcs_healthz", "/api/local_raylet_healthz"):
        assert f'"{path}"' in public.group(1), path


def test_worker_probe_asks_an_open_endpoint(helm: Helm) -> None:
    from ray.dashboard.http_server_agent import PUBLIC_EXACT_PATHS

    rendered = render(helm, {})
    for role in ROLES:
        (container,) = rendered.group(role)["template"]["spec"]["containers"]
        command = " ".join(container["readinessProbe"]["exec"]["command"])
        (path,) = re.findall(r"http://localhost:\d+(/\S+)", command)
        assert path in PUBLIC_EXACT_PATHS, path


# --------------------------------------------------------------- TLS on the front ends

TLS = {"tls": {"existingSecret": "tandem-tls"},
       "monitoring": {"serviceMonitor": {"tlsConfig": {
           "ca": {"secret": {"name": "tandem-tls", "key": "ca.crt"}},
           "serverName": "tandem.example.com"}}},
       "ingress": {"enabled": True}, "auth": {"allowUnauthenticatedExposure": True}}


def gateway_probes(rendered: Rendered) -> list[tuple[str, dict[str, Any]]]:
    """Every probe of a Ray container that asks the gateway's HTTP or gRPC port."""
    ports = {rendered.values["ports"]["http"], rendered.values["ports"]["grpc"], "serve",
             "grpc"}
    found = []
    for component in rendered.ray_groups():
        (container,) = rendered.group(component)["template"]["spec"]["containers"]
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = container.get(kind)
            if not probe:
                continue
            if probe.get("httpGet", {}).get("port") in ports or (
                    probe.get("grpc", {}).get("port") in ports):
                found.append((component, probe))
            command = " ".join(probe.get("exec", {}).get("command", []))
            if any(f":{p}" in command for p in ports if isinstance(p, int)):
                found.append((component, probe))
    return found


def probe_uses_tls(probe: dict[str, Any]) -> bool:
    if "httpGet" in probe:
        return probe["httpGet"].get("scheme") == "HTTPS"
    return "https://" in " ".join(probe.get("exec", {}).get("command", []))


def test_tls_is_mounted_in_the_gateways_pod_and_named_in_the_config(
        helm: Helm, crd_schema: dict[str, Any]) -> None:
    rendered = render(helm, _deep_merge(TLS, {"gateway": {"replicas": 1}}), "default")
    assert_valid(rendered, crd_schema)
    args = rendered.application["args"]
    assert (args["tls_cert_file"], args["tls_key_file"]) == (f"{MOUNT}/tls.crt",
                                                             f"{MOUNT}/tls.key")
    # The gateways run on the head and the gateway pods only (the resource only they offer):
    # the files are there, and nowhere else.
    (gateway_resource,) = rendered.deployment_options("gateway")["ray_actor_options"][
        "resources"]
    assert [c for c in rendered.ray_groups()
            if gateway_resource in rendered.group(c).get("resources", {})] == list(GATEWAY_PODS)
    for component in GATEWAY_PODS:
        assert mounted_file(rendered, component, args["tls_cert_file"]) == ("tandem-tls",
                                                                            "tls.crt")
        assert mounted_file(rendered, component, args["tls_key_file"]) == ("tandem-tls",
                                                                           "tls.key")
    for role in ROLES:
        with pytest.raises(AssertionError, match="no mounted Secret"):
            mounted_file(rendered, role, args["tls_cert_file"])
    # What talks to the gateway speaks HTTPS.
    http = rendered.one("Service", "-http")
    assert [p["appProtocol"] for p in http["spec"]["ports"]] == ["https"]
    (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == TLS["monitoring"]["serviceMonitor"]["tlsConfig"]
    annotations = rendered.one("Ingress")["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "HTTPS"
    assert all(probe_uses_tls(probe) for _, probe in gateway_probes(rendered))
    assert "gateway" in {component for component, _ in gateway_probes(rendered)}
    # The probe check would catch a plain-HTTP probe on the gateway's port.
    (head,) = rendered.group("head")["template"]["spec"]["containers"]
    head["readinessProbe"] = {"httpGet": {"path": "/health", "port": 8000}}
    assert not probe_uses_tls(gateway_probes(rendered)[0][1])


def test_without_tls_nothing_of_it(helm: Helm) -> None:
    rendered = render(helm, {"ingress": {"enabled": True},
                             "auth": {"allowUnauthenticatedExposure": True}})
    args = rendered.application["args"]
    assert not {"tls_cert_file", "tls_key_file"} & set(args)
    for component in rendered.ray_groups():
        assert not {"tls.crt", "tls.key"} & set(secrets_volume(rendered, component)[1])
    http = rendered.one("Service", "-http")
    assert [p["appProtocol"] for p in http["spec"]["ports"]] == ["http"]
    (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    assert "scheme" not in endpoint and "tlsConfig" not in endpoint
    assert "annotations" not in rendered.one("Ingress")["metadata"]
    assert not any(probe_uses_tls(probe) for _, probe in gateway_probes(rendered))


def test_tls_keeps_the_users_ingress_annotations(helm: Helm) -> None:
    rendered = render(helm, _deep_merge(TLS, {"ingress": {"annotations": {
        "nginx.ingress.kubernetes.io/backend-protocol": "GRPCS", "team": "serving"}}}))
    assert rendered.one("Ingress")["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/backend-protocol": "GRPCS", "team": "serving"}


def test_tls_needs_prometheus_told_how_to_check_the_certificate(helm: Helm) -> None:
    _fails(helm, {"tls": {"existingSecret": "tandem-tls"}},
           "tls.existingSecret: Prometheus scrapes /metrics over HTTPS and must be told how "
           "to check the certificate: set monitoring.serviceMonitor.tlsConfig")
    # No ServiceMonitor, or no Prometheus operator: nothing to tell.
    rendered = render(helm, {"tls": {"existingSecret": "tandem-tls"},
                             "monitoring": {"serviceMonitor": {"enabled": False}}})
    assert not rendered.of_kind("ServiceMonitor")
    assert rendered.application["args"]["tls_cert_file"] == f"{MOUNT}/tls.crt"
    objects = helm.template(*SKIP_KUBERAY_CHECK, "--set", "tls.existingSecret=tandem-tls")
    assert "ServiceMonitor" not in {o["kind"] for o in objects}


INTERNAL_TLS = {"internalTls": {"existingSecret": "tandem-internal-tls"}}


def test_internal_tls_is_mounted_in_every_worker_pod_and_named_in_the_config(
        helm: Helm, crd_schema: dict[str, Any]) -> None:
    rendered = render(helm, INTERNAL_TLS)
    assert_valid(rendered, crd_schema)
    args = rendered.application["args"]
    files = {"internal_tls_cert_file": ("internal-tls.crt", "tls.crt"),
             "internal_tls_key_file": ("internal-tls.key", "tls.key"),
             "internal_tls_ca_file": ("internal-ca.crt", "ca.crt")}
    for setting, (path, key) in files.items():
        assert args[setting] == f"{MOUNT}/{path}"
        for role in ROLES:  # where KV moves; the gateway's pod moves none
            assert mounted_file(rendered, role, args[setting]) == ("tandem-internal-tls", key)
        with pytest.raises(AssertionError, match="no mounted Secret"):
            mounted_file(rendered, "head", args[setting])
    assert args["kv_transport"] == "auto"  # TCP over TLS (services/kv_transfer/factory.py)
    without = render(helm, {}).application["args"]
    assert not set(files) & set(without)


def test_internal_tls_refuses_nixl(helm: Helm) -> None:
    _fails(helm, _deep_merge(INTERNAL_TLS, {"app": {"kv_transport": "nixl"}}),
           "internalTls.existingSecret: app.kv_transport nixl cannot take internal TLS")
    assert render(helm, _deep_merge(INTERNAL_TLS, {"app": {"kv_transport": "tcp"}}))


# ------------------------------------------------------------------------ refusals


def _fails(helm: Helm, overrides: dict[str, Any], message: str, base: str = "default") -> None:
    with pytest.raises(HelmError, match=re.escape(message)):
        render(helm, overrides, base)


def test_every_exposure_needs_api_keys(helm: Helm) -> None:
    _fails(helm, {"service": {"type": "LoadBalancer"}},
           "service.type LoadBalancer exposes the API outside the cluster: configure API keys "
           "first (auth.apiKeys.existingSecret")
    _fails(helm, {"service": {"type": "NodePort"}},
           "service.type NodePort exposes the API on every node's address: configure API keys")
    _fails(helm, {"ingress": {"enabled": True}},
           "ingress.enabled exposes the API through an Ingress: configure API keys")
    # The worked example's LoadBalancer without its keys.
    _fails(helm, {"auth": {"apiKeys": {"existingSecret": ""}}},
           "service.type LoadBalancer exposes the API", base="large-4p8d-autoscaling-values")
    for keys in ({"existingSecret": "my-keys"}, {"create": {"tenants": TENANTS}}):
        rendered = render(helm, {"service": {"type": "LoadBalancer"}, "auth": {"apiKeys": keys}})
        front = [rendered.one("Service", f"-{kind}") for kind in ("http", "grpc")]
        assert {s["spec"]["type"] for s in front} == {"LoadBalancer"}
    # Inside the cluster, or with the explicit override, no keys are needed.
    assert render(helm, {"service": {"type": "ClusterIP"}}).of_kind("Service")
    for exposure in ({"service": {"type": "NodePort"}}, {"ingress": {"enabled": True}},
                     {"service": {"type": "LoadBalancer"}}):
        assert render(helm, {**exposure, "auth": {"allowUnauthenticatedExposure": True}})


def test_metrics_behind_keys_need_a_bearer_token(helm: Helm) -> None:
    keys = {"apiKeys": {"existingSecret": "my-keys"}, "metricsRequireKey": True}
    message = ("auth.metricsRequireKey: Prometheus needs a key to scrape /metrics: set "
               "monitoring.serviceMonitor.bearerTokenSecret.name and .key")
    _fails(helm, {"auth": keys}, message)
    _fails(helm, {"auth": keys, "monitoring": {"serviceMonitor": {
        "bearerTokenSecret": {"name": "prom-key"}}}}, message)
    _fails(helm, {"auth": {"metricsRequireKey": True}, "monitoring": {"serviceMonitor": {
        "bearerTokenSecret": {"name": "prom-key", "key": "token"}}}},
        "auth.metricsRequireKey needs API keys")
    # No ServiceMonitor: whoever scrapes brings their own key.
    rendered = render(helm, {"auth": keys, "monitoring": {"serviceMonitor": {"enabled": False}}})
    assert not rendered.of_kind("ServiceMonitor")
    assert rendered.application["args"]["metrics_require_key"] is True


@pytest.mark.parametrize(("overrides", "message"), [
    ({"auth": {"apiKeys": {"existingSecret": "k", "create": {"tenants": TENANTS}}}},
     "auth.apiKeys: set either existingSecret (your Secret) or create.tenants"),
    ({"auth": {"apiKeys": {"create": {"tenants": {"a": ["shared-key-0000001"],
                                                  "b": ["shared-key-0000001"]}}}}},
     "auth.apiKeys.create.tenants: a key is given to both a and b"),
    ({"auth": {"apiKeys": {"create": {"tenants": {"a": ["short"]}}}}},
     "at '/auth/apiKeys/create/tenants/a/0'"),
    ({"auth": {"apiKeys": {"create": {"tenants": {"a": ["has a space in it 0001"]}}}}},
     "at '/auth/apiKeys/create/tenants/a/0'"),
    ({"auth": {"apiKeys": {"create": {"tenants": {"a:b": ["key-with-colon-tenant"]}}}}},
     "invalid propertyName 'a:b'"),
    ({"auth": {"apiKeyz": {}}}, "at '/auth': additional properties 'apiKeyz' not allowed"),
    ({"networkPolicy": {"operatorFrom": [{"namespaceSelector": {}}]}},
     "at '/networkPolicy': additional properties 'operatorFrom' not allowed"),
    ({"podSecurityContext": {"fsGroup": None}}, "podSecurityContext.fsGroup must be set"),
    ({"rayVersion": "2.51.1"}, "auth.rayToken needs Ray 2.52 or later (rayVersion is 2.51.1)"),
    ({"head": {"extraEnv": [{"name": "RAY_AUTH_TOKEN", "value": "x" * 32}]}},
     "head.extraEnv: RAY_AUTH_TOKEN is set by the chart (auth.rayToken)"),
    ({"extraEnv": [{"name": "RAY_AUTH_MODE", "value": "disabled"}]},
     "extraEnv: RAY_AUTH_MODE is set by the chart (auth.rayToken)"),
    ({"auth": {"rayToken": {"secretName": "x"}}},
     "at '/auth/rayToken': additional properties 'secretName' not allowed"),
    ({"tls": {"existingSecret": "Not_A_Name"}}, "at '/tls/existingSecret'"),
    ({"tls": {"existingSecret": "t"}, "monitoring": {"serviceMonitor": {"tlsConfig": {
        "insecureSkipVerifY": True}}}},
     "additional properties 'insecureSkipVerifY' not allowed"),
])
def test_bad_auth_values_fail_clearly(helm: Helm, overrides: dict[str, Any],
                                      message: str) -> None:
    _fails(helm, overrides, message)


def test_notes_say_whether_keys_are_on(helm: Helm, tmp_path: Path) -> None:
    def notes(overrides: dict[str, Any]) -> str:
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump(overrides))
        return helm.check("install", RELEASE, str(CHART_DIR), "--dry-run=client",
                          "--namespace", NAMESPACE, "-f", str(values), *SKIP_KUBERAY_CHECK)

    off = notes({})
    assert "API keys:\n  OFF: any client that reaches the Services may call the API" in off
    on = notes({"auth": {"apiKeys": {"existingSecret": "my-keys"}}})
    assert "API keys:\n  ON: every HTTP and gRPC request needs" in on
    assert "the Secret my-keys (key api-keys)" in on
    dev = notes({"auth": {"apiKeys": {"create": {"tenants": TENANTS}}}})
    assert "for tests and development only" in dev
    assert TENANTS["team-a"][0] not in dev.split("NOTES:")[-1]  # no key printed in the notes

    # Ray's token and TLS.
    assert (f"Ray token authentication: ON, the token in the Secret {RELEASE}-ray-token "
            "(key auth_token)") in off
    assert f"get secret {RELEASE}-ray-token -o jsonpath='{{.data.auth_token}}'" in off
    manifest = off.split("MANIFEST:")[1].split("NOTES:")[0]
    (token,) = [o for o in yaml.safe_load_all(manifest)
                if o and o["metadata"]["name"] == f"{RELEASE}-ray-token"]
    assert base64.b64decode(token["data"]["auth_token"]).decode() not in off.split("NOTES:")[-1]
    assert "Ray token authentication: OFF" in notes({"auth": {"rayToken": {"enabled": False}}})
    assert "TLS on HTTP and gRPC: OFF" in off and "grpcurl -plaintext" in off
    tls = notes({"tls": {"existingSecret": "tandem-tls"}}).split("NOTES:")[-1]
    assert "TLS on HTTP and gRPC: ON, the certificate in the Secret tandem-tls" in tls
    assert "http://" not in tls and "-plaintext" not in tls
    assert f"https://{RELEASE}-http.{NAMESPACE}.svc:8000/v1" in tls
