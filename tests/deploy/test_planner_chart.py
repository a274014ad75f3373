"""The planner's objects in the chart: none by default; when enabled a Deployment running
`tandem plan --loop --apply` as a ServiceAccount whose Role may only get and patch this
release's RayService; all valid Kubernetes (kubernetes-validate)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import kubernetes_validate
import pytest

from tandem.services.planner.cli import add_parser
from tandem.services.planner.sizing import Profile
from tests.deploy.conftest import CHART_DIR, NAMESPACE, Helm, HelmError
from tests.deploy.test_helm_chart import K8S_VERSIONS, SKIP_KUBERAY_CHECK

PLANNER_VALUES = CHART_DIR / "ci" / "planner-values.yaml"
PLANNER_KINDS = {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment"}


def _planner_objects(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    found = [o for o in objects
             if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "planner"]
    by_kind = {o["kind"]: o for o in found}
    assert len(by_kind) == len(found), "one object of each kind"
    return by_kind


def test_off_by_default(helm: Helm) -> None:
    objects = helm.template(*SKIP_KUBERAY_CHECK)
    assert _planner_objects(objects) == {}
    assert not {o["kind"] for o in objects} & {"ServiceAccount", "Role", "RoleBinding"}
    (service,) = [o for o in objects if o["kind"] == "RayService"]
    assert "annotations" not in service["metadata"]


def test_enabled_renders_a_scoped_role_and_a_valid_deployment(helm: Helm) -> None:
    objects = helm.template("-f", str(PLANNER_VALUES), *SKIP_KUBERAY_CHECK)
    planner = _planner_objects(objects)
    assert set(planner) == PLANNER_KINDS
    for version in K8S_VERSIONS:
        for obj in planner.values():
            kubernetes_validate.validate(obj, version, strict=True)
    (service,) = [o for o in objects if o["kind"] == "RayService"]
    name = service["metadata"]["name"]
    # The Role: this one RayService, get and patch, nothing else.
    assert planner["Role"]["rules"] == [{"apiGroups": ["ray.io"], "resources": ["rayservices"],
                                         "resourceNames": [name], "verbs": ["get", "patch"]}]
    binding = planner["RoleBinding"]
    assert binding["roleRef"]["name"] == planner["Role"]["metadata"]["name"]
    account = planner["ServiceAccount"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": NAMESPACE}]
    pod = planner["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:4] == ["tandem", "plan", "--loop", "--apply"]
    assert f"--rayservice={name}" in command and f"--namespace={NAMESPACE}" in command
    assert "--ttft-ms=800" in command and "--tpot-ms=60" in command
    # The command is one `tandem plan` parses, and the profile one it loads.
    parser = argparse.ArgumentParser(prog="tandem")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(command[1:])
    assert (args.loop, args.apply, args.ttft_ms, args.tpot_ms) == (True, True, 800.0, 60.0)
    assert (args.rayservice, args.namespace) == (name, NAMESPACE)
    assert args.url == f"http://{name}-http:8000"
    (http,) = [o for o in objects if o["kind"] == "Service"
               and o["metadata"]["name"] == f"{name}-http"]
    assert 8000 in [p["port"] for p in http["spec"]["ports"]]
    (mount,) = container["volumeMounts"][:1]
    assert args.profile.parent.as_posix() == mount["mountPath"]
    profile = Profile.from_json(json.loads(planner["ConfigMap"]["data"]["profile.json"]))
    assert profile.prefill_tokens_per_s == 9000 and profile.max_num_seqs == 128
    # The bounds the planner clamps to ride on the RayService.
    assert service["metadata"]["annotations"] == {"tandem.dev/planner-prefill-bounds": "1-3",
                                                  "tandem.dev/planner-decode-bounds": "2-6"}


def test_an_existing_service_account_gets_no_role(helm: Helm) -> None:
    objects = helm.template("-f", str(PLANNER_VALUES), *SKIP_KUBERAY_CHECK,
                            "--set", "planner.rbac.create=false",
                            "--set", "planner.serviceAccountName=ops-planner")
    planner = _planner_objects(objects)
    assert set(planner) == {"ConfigMap", "Deployment"}
    assert planner["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == \
        "ops-planner"


@pytest.mark.parametrize(("settings", "message"), [
    (("planner.enabled=true",), "planner.profile: set one worker's capacity"),
    (("planner.rbac.create=false",), "set planner.serviceAccountName"),
    (("planner.bounds.decode.min=7",), r"planner.bounds.decode: min \(7\) must not exceed"),
])
def test_planner_values_fail_clearly(helm: Helm, settings: tuple[str, ...],
                                     message: str) -> None:
    base = () if settings == ("planner.enabled=true",) else ("-f", str(PLANNER_VALUES))
    sets = [arg for s in settings for arg in ("--set", s)]
    with pytest.raises(HelmError, match=message):
        helm.template(*base, *SKIP_KUBERAY_CHECK, *sets)
