"""model.hubId: a Hugging Face model that every Ray pod's init container fetches (`tandem fetch`,
the token from model.hubTokenSecret's Secret) into the hub cache (model.hubCache, mounted at /hf
as HF_HOME), which the Ray containers then read offline (HF_HUB_OFFLINE=1).

Rendered with the real helm and checked against Kubernetes' schemas (each pod template too, as
a PodTemplate: KubeRay's CRD alone would take any container) and KubeRay's; then the rendered
init container's command and the Ray container's env, run here against a hub cache in the
hub's own layout, resolve the same snapshot.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import (
    CHART_DIR,
    NAMESPACE,
    RELEASE,
    SHARED_SCHEMAS,
    Helm,
    HelmError,
)
from tests.deploy.test_chart_security import ray_env, render
from tests.deploy.test_helm_chart import (
    K8S_VERSIONS,
    ROLES,
    SKIP_KUBERAY_CHECK,
    Rendered,
    _strict,
)
from tests.deploy.test_model_fetch import COMMIT, REPO, write_hub_cache

HF_HOME = "/hf"
COMPONENTS = ("head", *ROLES)
TOKEN_SECRET = {"name": "hf-token", "key": "token"}
PROXY = {"name": "HTTPS_PROXY", "value": "http://proxy.example.internal:3128"}
SHARED_PVC = {"emptyDir": None, "persistentVolumeClaim": {"claimName": "hf-cache"}}

CASES: dict[str, dict[str, Any]] = {
    "hub id": {"model": {"hubId": REPO}},
    "hub id, token": {"model": {"hubId": REPO, "hubTokenSecret": TOKEN_SECRET}},
    "revision, shared PVC, token, proxy": {
        "model": {"hubId": f"{REPO}@{COMMIT}", "hubCache": SHARED_PVC,
                  "hubTokenSecret": TOKEN_SECRET},
        "extraEnv": [PROXY]},
}


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((SHARED_SCHEMAS / "kuberay" / "ray.io_rayservices.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(v1["schema"]["openAPIV3Schema"])


def assert_valid(rendered: Rendered, crd_schema: dict[str, Any]) -> None:
    """Every object and every Ray pod template valid Kubernetes; the RayService valid against
    KubeRay's CRD."""
    pods = [{"apiVersion": "v1", "kind": "PodTemplate",
             "metadata": {"name": f"{RELEASE}-{component}"},
             "template": rendered.group(component)["template"]} for component in COMPONENTS]
    for version in K8S_VERSIONS:
        for obj in [*rendered.objects, *pods]:
            if obj["kind"] in {"RayService", "ServiceMonitor", "PrometheusRule"}:
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']} {obj['metadata']['name']} is not valid Kubernetes "
                            f"{version}: {exc.message} at {list(exc.path)}")
    errors = list(jsonschema.Draft7Validator(crd_schema).iter_errors(rendered.ray_service))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


def fetch_container(rendered: Rendered, component: str) -> dict[str, Any]:
    (init,) = rendered.group(component)["template"]["spec"]["initContainers"]
    return init


def by_name(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), f"duplicate names: {names}"
    return {e["name"]: e for e in entries}


def paths_to(value: str, node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where a string occurs in a rendered object (as a whole value, or inside a longer one)."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in paths_to(value, v, (*path, k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in paths_to(value, v, (*path, i))]
    return [path] if isinstance(node, str) and value in node else []


@pytest.mark.parametrize("case", list(CASES))
def test_every_ray_pod_fetches_the_model_first(helm: Helm, crd_schema: dict[str, Any],
                                               case: str) -> None:
    rendered = render(helm, CASES[case])
    assert_valid(rendered, crd_schema)
    values = rendered.values
    model = values["model"]
    cache = {k: v for k, v in model["hubCache"].items() if v is not None}  # null: dropped
    token = model["hubTokenSecret"]
    # The engines (and the gateway's tokenizer) resolve the id itself, from the cache.
    assert rendered.application["args"]["model"] == model["hubId"]

    for component in COMPONENTS:
        spec = rendered.group(component)["template"]["spec"]
        (ray,) = spec["containers"]
        init = fetch_container(rendered, component)
        assert init["name"] == "fetch-model"
        assert init["command"] == ["tandem", "fetch", model["hubId"]]
        assert (init["image"], init["imagePullPolicy"]) == (ray["image"], ray["imagePullPolicy"])
        assert init["securityContext"] == ray["securityContext"] == values["securityContext"]
        assert init["resources"] == model["fetchResources"]

        env = by_name(init["env"])
        assert env.pop("HF_HOME") == {"name": "HF_HOME", "value": HF_HOME}
        if token:
            assert env.pop("HF_TOKEN") == {"name": "HF_TOKEN",
                                           "valueFrom": {"secretKeyRef": token}}
        # The pod's own extraEnv (a proxy, HF_ENDPOINT), nothing else: no Ray token, and
        # HF_HUB_OFFLINE only where the cache is read.
        extra = [*values["extraEnv"], *(values[component].get("extraEnv") or [])]
        assert list(env.values()) == extra, component

        volumes = by_name(spec["volumes"])
        assert {k: v for k, v in volumes["hf-cache"].items() if k != "name"} == cache
        mounts = by_name(init["volumeMounts"])
        assert mounts["hf-cache"] == {"name": "hf-cache", "mountPath": HF_HOME}  # writable
        assert set(mounts) <= set(volumes)
        for mount in mounts.values():  # the root filesystem is read-only: emptyDirs or the cache
            assert mount["name"] == "hf-cache" or "emptyDir" in volumes[mount["name"]], mount

        ray_vars = ray_env(rendered, component)
        assert ray_vars["HF_HOME"] == {"name": "HF_HOME", "value": HF_HOME}
        assert ray_vars["HF_HUB_OFFLINE"] == {"name": "HF_HUB_OFFLINE", "value": "1"}
        assert "HF_TOKEN" not in ray_vars  # the Ray containers never see the token
        assert {"name": "hf-cache", "mountPath": HF_HOME, "readOnly": True} in ray[
            "volumeMounts"]


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c]["model"].get("hubTokenSecret")])
def test_the_token_is_only_a_secret_key_ref(helm: Helm, case: str) -> None:
    rendered = render(helm, CASES[case])
    found = [(obj["kind"], path) for obj in rendered.objects
             for path in paths_to(TOKEN_SECRET["name"], obj)]
    # One reference per Ray pod, each a secretKeyRef in the init container; no Secret of it
    # is rendered (it is the user's), nor is it in the serve config.
    assert len(found) == len(COMPONENTS), found
    for kind, path in found:
        assert kind == "RayService" and path[-2:] == ("secretKeyRef", "name"), path
        assert "initContainers" in path, path
    for obj in rendered.objects:
        for path in paths_to("HF_TOKEN", obj):
            assert "initContainers" in path and path[-1] == "name", (obj["kind"], path)


def test_without_a_hub_id_nothing_of_it(helm: Helm) -> None:
    for overrides in ({}, {"model": {"path": "llama", "volume": {
            "persistentVolumeClaim": {"claimName": "models"}}}}):
        rendered = render(helm, overrides)
        for component in COMPONENTS:
            spec = rendered.group(component)["template"]["spec"]
            assert "initContainers" not in spec
            assert "hf-cache" not in {v["name"] for v in spec["volumes"]}
            assert not {n for n in ray_env(rendered, component) if n.startswith("HF_")}
        for obj in rendered.objects:
            for word in ("hf-cache", "fetch-model", "HF_HUB_OFFLINE"):
                assert not paths_to(word, obj), (obj["kind"], word)


def test_the_rendered_pods_resolve_the_snapshot_offline(helm: Helm, tmp_path: Path) -> None:
    """The init container's own command and env fill the cache (offline here: the test's cache
    stands in for the download); the Ray container's env finds the snapshot there offline."""
    snapshot = write_hub_cache(tmp_path / "hf")
    rendered = render(helm, CASES["hub id, token"])
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}

    def pod_env(entries: list[dict[str, Any]]) -> dict[str, str]:
        plain = {e["name"]: e["value"] for e in entries if "value" in e}
        assert plain["HF_HOME"] == HF_HOME
        return {**base, **plain, "HF_HOME": str(tmp_path / "hf")}  # /hf, here

    for component in COMPONENTS:
        init = fetch_container(rendered, component)
        program, *args = init["command"]
        assert program == "tandem"
        fetched = subprocess.run(
            [sys.executable, "-m", "tandem.services.cli", *args],
            env={**pod_env(init["env"]), "HF_HUB_OFFLINE": "1"},
            capture_output=True, text=True, timeout=120, check=False)
        assert fetched.returncode == 0, fetched.stderr
        assert fetched.stdout.strip() == str(snapshot)

    (ray,) = rendered.group("decode")["template"]["spec"]["containers"]
    resolve = ("import sys; from tandem.services.engine.tokenizer_loader import model_source; "
               "print(model_source(sys.argv[1]))")
    resolved = subprocess.run(
        [sys.executable, "-c", resolve, rendered.application["args"]["model"]],
        env=pod_env(ray["env"]), capture_output=True, text=True, timeout=120, check=False)
    assert resolved.returncode == 0, resolved.stderr
    assert resolved.stdout.strip() == str(snapshot)


def test_notes_say_where_the_download_is_logged(helm: Helm) -> None:
    def notes(*settings: str) -> str:
        return helm.check("install", RELEASE, str(CHART_DIR), "--dry-run=client",
                          "--namespace", NAMESPACE, *SKIP_KUBERAY_CHECK, *settings)

    with_hub = notes("--set", f"model.hubId={REPO}")
    assert f"Each Ray pod first downloads {REPO} (its init container fetch-model" in with_hub
    assert f"kubectl -n {NAMESPACE} logs <pod> -c fetch-model" in with_hub
    assert "fetch-model" not in notes()


# ------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model": {"hubId": REPO, "path": "llama",
                "volume": {"persistentVolumeClaim": {"claimName": "models"}}}},
     "model: set either model.path (a model on model.volume) or model.hubId (a Hugging Face "
     "id fetched by an init container), not both"),
    ({"model": {"hubTokenSecret": TOKEN_SECRET}},
     "model.hubTokenSecret is the token for model.hubId: set model.hubId, or remove "
     "model.hubTokenSecret"),
    ({"model": {"hubId": REPO, "hubCache": {"persistentVolumeClaim": {"claimName": "c"}}}},
     "model.hubCache: give one volume source, got [emptyDir, persistentVolumeClaim] (Helm "
     "merges your values into the default: set emptyDir: null beside your source)"),
    ({"model": {"hubId": REPO}, "extraEnv": [{"name": "HF_HUB_OFFLINE", "value": "0"}]},
     "extraEnv: HF_HUB_OFFLINE is set by the chart with model.hubId: remove it"),
    ({"model": {"hubId": REPO}, "decode": {"extraEnv": [{"name": "HF_TOKEN", "value": "x"}]}},
     "decode.extraEnv: HF_TOKEN is set by the chart with model.hubId: remove it (a token: "
     "model.hubTokenSecret)"),
    ({"model": {"hubId": REPO}, "head": {"extraEnv": [{"name": "HF_HOME", "value": "/x"}]}},
     "head.extraEnv: HF_HOME is set by the chart with model.hubId"),
])
def test_inconsistent_hub_values_fail_clearly(helm: Helm, overrides: dict[str, Any],
                                              message: str) -> None:
    with pytest.raises(HelmError, match=re.escape(message)):
        render(helm, overrides)


@pytest.mark.parametrize(("model", "where"), [
    ({"hubId": "just-a-name"}, "/model/hubId"),
    ({"hubId": "org/name/extra"}, "/model/hubId"),
    ({"hubId": "org/na me"}, "/model/hubId"),
    ({"hubId": "org/name@"}, "/model/hubId"),
    ({"hubId": "-org/name"}, "/model/hubId"),
    ({"hubId": "org/name\"]; rm -rf /"}, "/model/hubId"),
    ({"hubId": REPO, "hubTokenSecret": {"name": "hf-token"}}, "/model/hubTokenSecret"),
    ({"hubId": REPO, "hubTokenSecret": {"name": "Not_A_Name", "key": "token"}},
     "/model/hubTokenSecret/name"),
    ({"hubId": REPO, "hubTokenSecret": {"name": "hf-token", "key": "token", "value": "hf_x"}},
     "/model/hubTokenSecret"),
    ({"hubId": REPO, "hubCache": {"emptyDir": None}}, "/model/hubCache"),
    ({"hubId": REPO, "fetchResources": {"request": {}}}, "/model/fetchResources"),
])
def test_bad_hub_values_fail_the_schema(helm: Helm, model: dict[str, Any], where: str) -> None:
    with pytest.raises(HelmError, match=re.escape(f"at '{where}'")):
        render(helm, {"model": model})


@pytest.mark.parametrize("command", ["template", "lint"])
def test_a_bad_hub_id_fails_template_and_lint(helm: Helm, command: str) -> None:
    args = ("template", RELEASE) if command == "template" else ("lint", "--strict")
    result = helm.run(*args, str(CHART_DIR), *SKIP_KUBERAY_CHECK, "--set", "model.hubId=llama")
    assert result.returncode != 0
    assert "at '/model/hubId'" in result.stdout + result.stderr
