"""The chart's security settings (issue 18, chart side), rendered with the real helm.

What the NetworkPolicies admit (no any-source rule on a worker port or the Ray dashboard, any
source on HTTP/gRPC only with networkPolicy.allowAnySource), the API-key and cluster Secrets and
their wiring into the pods and the serve config, and the refusals: a LoadBalancer without keys,
a /metrics behind keys that Prometheus is given no key for.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import CHART_DIR, NAMESPACE, RELEASE, Helm, HelmError
from tests.deploy.test_helm_chart import (
    K8S_VERSIONS,
    ROLES,
    SKIP_KUBERAY_CHECK,
    VALUE_SETS,
    Rendered,
    _deep_merge,
    other_release,
    render_args,
    selects,
    values_for,
)

DASHBOARD = 8265
MOUNT = "/etc/tandem/secrets"
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


def secrets_volume(rendered: Rendered, component: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The pod's secrets volume and {file: Secret name} it projects."""
    spec = rendered.group(component)["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "secrets"]
    files = {}
    for source in volume["projected"]["sources"]:
        (item,) = source["secret"]["items"]
        assert item["key"] == item["path"]
        files[item["path"]] = source["secret"]["name"]
    return volume, files


SECRET_CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "existing keys": {"auth": {"apiKeys": {"existingSecret": "my-keys"}}},
    "created keys": {"auth": {"apiKeys": {"create": {"tenants": TENANTS}}}},
    "existing cluster secret": {"auth": {"clusterSecret": {"existingSecret": "my-cluster"}}},
    "metrics behind keys": {
        "auth": {"apiKeys": {"existingSecret": "my-keys"}, "metricsRequireKey": True},
        "monitoring": {"serviceMonitor": {"bearerTokenSecret": {"name": "prom-key",
                                                                 "key": "token"}}}},
}


@pytest.mark.parametrize("case", list(SECRET_CASES))
def test_secrets_are_wired_into_the_pods_and_the_serve_config(helm: Helm, case: str) -> None:
    overrides = SECRET_CASES[case]
    rendered = render(helm, overrides)
    auth = rendered.values["auth"]
    fullname = rendered.ray_service["metadata"]["name"]
    secrets = {s["metadata"]["name"]: s for s in rendered.of_kind("Secret")}

    # Every rendered object is still valid Kubernetes, the Secrets included.
    for version in K8S_VERSIONS:
        for obj in rendered.objects:
            if obj["kind"] in {"RayService", "ServiceMonitor", "PrometheusRule"}:
                continue
            kubernetes_validate.validate(obj, version, strict=True)
    for secret in secrets.values():
        assert (secret["apiVersion"], secret["type"]) == ("v1", "Opaque")

    keys_secret = auth["apiKeys"]["existingSecret"] or (
        f"{fullname}-api-keys" if auth["apiKeys"]["create"]["tenants"] else None)
    cluster_secret = auth["clusterSecret"]["existingSecret"] or f"{fullname}-cluster-secret"
    created = {n for n in (keys_secret, cluster_secret) if n and n.startswith(fullname)}
    assert set(secrets) == created

    if f"{fullname}-api-keys" in secrets:
        text = base64.b64decode(secrets[f"{fullname}-api-keys"]["data"]["api-keys"]).decode()
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
        assert lines == [f"{t}:{k}" for t, keys in TENANTS.items() for k in keys]
    if f"{fullname}-cluster-secret" in secrets:
        value = base64.b64decode(secrets[f"{fullname}-cluster-secret"]["data"]["cluster-secret"])
        assert re.fullmatch(rb"[A-Za-z0-9]{48}", value)

    # Mounted read-only, readable by the pod's group only: the head gets both files, the
    # workers the cluster secret.
    for component in ("head", *ROLES):
        spec = rendered.group(component)["template"]["spec"]
        volume, files = secrets_volume(rendered, component)
        assert volume["projected"]["defaultMode"] == 0o440
        assert spec["securityContext"]["fsGroup"]
        expected = {"cluster-secret": cluster_secret}
        if component == "head" and keys_secret:
            expected["api-keys"] = keys_secret
        assert files == expected, component
        (container,) = spec["containers"]
        mounts = [m for m in container["volumeMounts"] if m["name"] == "secrets"]
        assert mounts == [{"name": "secrets", "mountPath": MOUNT, "readOnly": True}]

    args = rendered.application["args"]
    assert args["cluster_secret_file"] == f"{MOUNT}/cluster-secret"
    assert args.get("api_keys_file") == (f"{MOUNT}/api-keys" if keys_secret else None)
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


# ------------------------------------------------------------------------ refusals


def _fails(helm: Helm, overrides: dict[str, Any], message: str, base: str = "default") -> None:
    with pytest.raises(HelmError, match=re.escape(message)):
        render(helm, overrides, base)


def test_load_balancer_needs_api_keys(helm: Helm) -> None:
    _fails(helm, {"service": {"type": "LoadBalancer"}},
           "service.type LoadBalancer exposes the API outside the cluster: configure API keys "
           "first (auth.apiKeys.existingSecret")
    # The worked example's LoadBalancer without its keys.
    _fails(helm, {"auth": {"apiKeys": {"existingSecret": ""}}},
           "service.type LoadBalancer exposes the API", base="large-4p8d-autoscaling-values")
    for keys in ({"existingSecret": "my-keys"}, {"create": {"tenants": TENANTS}}):
        rendered = render(helm, {"service": {"type": "LoadBalancer"}, "auth": {"apiKeys": keys}})
        front = [rendered.one("Service", f"-{kind}") for kind in ("http", "grpc")]
        assert {s["spec"]["type"] for s in front} == {"LoadBalancer"}
    # Nothing else refuses to run without keys.
    for kind in ("ClusterIP", "NodePort"):
        assert render(helm, {"service": {"type": kind}}).of_kind("Service")


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
