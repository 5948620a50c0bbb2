"""The Kubernetes example (integrations/kubernetes), checked offline.

``kubectl apply -k`` is rendered here in Python: the kustomization may only use the
fields this renderer implements (a list of local ``resources:``), so a kustomization
that grows a patch or a generator fails until the renderer learns it.  On the rendered
set: every object a pod spec refers to (PersistentVolumeClaim, ConfigMap, Secret,
Service of a StatefulSet) is defined, selectors select something, and the image is
tagged with the package's version.  Each core manifest is validated against the
Kubernetes JSON schemas (``kubernetes-validate``, strict: unknown fields fail); the
prometheus-operator kinds, which those schemas lack, against the schemas below, written
from the fields the operator's CRDs document (unknown fields fail there too).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hicache_existence._version import __version__

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "integrations" / "kubernetes"
#: The Kubernetes versions the core manifests must validate against.
KUBE_VERSIONS = ("1.30.0", "1.37.0")
#: The kustomization fields the renderer implements.
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources"}
IMAGE = "registry.example.com/sglang-hicache-existence"

Manifest = dict[str, Any]


class RenderError(Exception):
    """A kustomization the renderer cannot render."""


def _documents(path: Path) -> list[Manifest]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def render(directory: Path) -> list[tuple[str, Manifest]]:
    """What ``kubectl apply -k directory`` would apply, as (file, manifest) pairs."""
    (kust,) = _documents(directory / "kustomization.yaml")
    if kust.get("kind") != "Kustomization":
        raise RenderError(f"kustomization.yaml: kind {kust.get('kind')!r}")
    unknown = set(kust) - KUSTOMIZATION_FIELDS
    if unknown:
        raise RenderError(f"kustomization.yaml: fields the renderer lacks: {sorted(unknown)}")
    rendered: list[tuple[str, Manifest]] = []
    for entry in kust["resources"]:
        path = directory / entry
        if not path.is_file():
            raise RenderError(f"kustomization.yaml: resource {entry} is not a file")
        rendered.extend((entry, doc) for doc in _documents(path))
    keys = [(m["kind"], m["metadata"]["name"]) for _, m in rendered]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise RenderError(f"defined twice: {duplicates}")
    return rendered


def _pod_templates(manifests: list[Manifest]) -> Iterator[tuple[Manifest, Manifest]]:
    for m in manifests:
        if m["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
            yield m, m["spec"]["template"]


def _selected(selector: Manifest, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions In/NotIn/Exists) matches."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def reference_errors(manifests: list[Manifest]) -> list[str]:
    """Everything a pod spec, Service or monitor refers to that the set does not define."""
    defined = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    errors: list[str] = []

    def need(kind: str, name: str, where: str) -> None:
        if (kind, name) not in defined:
            errors.append(f"{where}: {kind} {name!r} is not defined")

    pods: list[tuple[Manifest, dict[str, str]]] = []
    for owner, template in _pod_templates(manifests):
        where = f"{owner['kind']} {owner['metadata']['name']}"
        labels = template["metadata"].get("labels", {})
        pods.append((template, labels))
        if not _selected(owner["spec"]["selector"], labels):
            errors.append(f"{where}: its selector does not match its pod template")
        if owner["kind"] == "StatefulSet":
            need("Service", owner["spec"]["serviceName"], where)
        spec = template["spec"]
        claims = {t["metadata"]["name"] for t in owner["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                need("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], where)
            if "configMap" in volume:
                need("ConfigMap", volume["configMap"]["name"], where)
            if "secret" in volume:
                need("Secret", volume["secret"]["secretName"], where)
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes and mount["name"] not in claims:
                    errors.append(f"{where}: volumeMount {mount['name']!r} names no volume")
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    need("ConfigMap", source["configMapRef"]["name"], where)
                if "secretRef" in source:
                    need("Secret", source["secretRef"]["name"], where)
            for env in container.get("env", []):
                ref = env.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    need("ConfigMap", ref["configMapKeyRef"]["name"], where)
                if "secretKeyRef" in ref:
                    need("Secret", ref["secretKeyRef"]["name"], where)
    ports = {p["name"] for t, _ in pods for c in t["spec"]["containers"] for p in c["ports"]}
    for m in manifests:
        where = f"{m['kind']} {m['metadata']['name']}"
        if m["kind"] == "Service":
            if not any(_selected({"matchLabels": m["spec"]["selector"]}, lb) for _, lb in pods):
                errors.append(f"{where}: selects no pod")
            for port in m["spec"]["ports"]:
                if isinstance(port.get("targetPort"), str) and port["targetPort"] not in ports:
                    errors.append(f"{where}: targetPort {port['targetPort']!r} is no pod port")
        if m["kind"] == "PodMonitor":
            if not any(_selected(m["spec"]["selector"], lb) for _, lb in pods):
                errors.append(f"{where}: selects no pod")
            for endpoint in m["spec"]["podMetricsEndpoints"]:
                if endpoint["port"] not in ports:
                    errors.append(f"{where}: port {endpoint['port']!r} is no pod port")
    return errors


# --- prometheus-operator (monitoring.coreos.com/v1), from the CRDs' documented fields --
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)(y|w|d|h|m|s|ms))+)$"}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STR_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {
            "enum": [
                "replace",
                "Replace",
                "keep",
                "Keep",
                "drop",
                "Drop",
                "hashmod",
                "HashMod",
                "labelmap",
                "LabelMap",
                "labeldrop",
                "LabelDrop",
                "labelkeep",
                "LabelKeep",
                "lowercase",
                "Lowercase",
                "uppercase",
                "Uppercase",
                "keepequal",
                "KeepEqual",
                "dropequal",
                "DropEqual",
            ]
        },
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string"},
        "targetPort": {"type": ["string", "integer"]},
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "honorTimestamps": {"type": "boolean"},
        "relabelings": {"type": "array", "items": _RELABEL},
        "metricRelabelings": {"type": "array", "items": _RELABEL},
    },
}
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
    "properties": {
        "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "alert": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"},
        "expr": {"type": ["string", "integer"], "minLength": 1},
        "for": _DURATION,
        "keep_firing_for": _DURATION,
        "labels": _STR_MAP,
        "annotations": _STR_MAP,
    },
}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "labels": _STR_MAP,
        "annotations": _STR_MAP,
    },
}


def _crd(spec: Manifest) -> Manifest:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"type": "string"},
            "metadata": _METADATA,
            "spec": {"type": "object", "additionalProperties": False, **spec},
        },
    }


OPERATOR_SCHEMAS: dict[str, Manifest] = {
    "PrometheusRule": _crd(
        {
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "limit": {"type": "integer"},
                            "rules": {"type": "array", "items": _RULE},
                        },
                    },
                }
            },
        }
    ),
    "PodMonitor": _crd(
        {
            "required": ["selector"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT},
            },
        }
    ),
    "ServiceMonitor": _crd(
        {
            "required": ["selector"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {"type": "array", "items": _ENDPOINT},
            },
        }
    ),
}


def schema_errors(manifest: Manifest) -> list[str]:
    """Schema violations of one manifest (core kinds: the Kubernetes schemas)."""
    kind = manifest.get("kind")
    if kind in OPERATOR_SCHEMAS:
        validator = jsonschema.Draft202012Validator(OPERATOR_SCHEMAS[kind])
        return [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(manifest)
        ]
    errors = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(map(str, exc.path))
            errors.append(f"Kubernetes {version}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"Kubernetes {version}: no schema for {manifest.get('apiVersion')}")
    return errors


def _manifest_files() -> list[Path]:
    return sorted(p for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")


# --- the tests ------------------------------------------------------------------------
def test_the_kustomization_renders_and_defines_what_pods_use() -> None:
    """Every resource of the kustomization exists, and every claim, ConfigMap, Secret,
    Service and selector the rendered objects refer to is defined (the L3 claim
    hicache-l3 of the prefill pods included)."""
    manifests = [m for _, m in render(KUBE)]
    assert reference_errors(manifests) == []
    kinds = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    assert ("PersistentVolumeClaim", "hicache-l3") in kinds


def test_every_manifest_file_is_rendered_or_an_alternative() -> None:
    """A manifest left out of the kustomization is only the ServiceMonitor (the
    documented alternative to the PodMonitor), which validates against the same pods."""
    rendered = {f for f, _ in render(KUBE)}
    assert {p.name for p in _manifest_files()} - rendered == {"servicemonitor.yaml"}
    manifests = [m for _, m in render(KUBE)]
    (monitor,) = _documents(KUBE / "servicemonitor.yaml")
    services = [m for m in manifests if m["kind"] == "Service"]
    assert any(
        _selected(monitor["spec"]["selector"], s["metadata"].get("labels", {})) for s in services
    )


@pytest.mark.parametrize("name", [p.name for p in _manifest_files()])
def test_manifest_is_valid_against_its_schema(name: str) -> None:
    """Each manifest validates strictly: the Kubernetes schemas for core kinds, the
    prometheus-operator CRD fields for PrometheusRule, PodMonitor, ServiceMonitor."""
    for manifest in _documents(KUBE / name):
        assert schema_errors(manifest) == [], manifest["kind"]


def test_the_shared_l3_claim_is_readwritemany() -> None:
    """The claim every prefill replica mounts is ReadWriteMany with a storage class
    named (the operator's to set), and the prefill StatefulSet has several replicas."""
    manifests = [m for _, m in render(KUBE)]
    (claim,) = [m for m in manifests if m["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"]
    prefill = next(
        m
        for m in manifests
        if m["metadata"]["name"] == "sglang-prefill" and m["kind"] == "StatefulSet"
    )
    volumes = prefill["spec"]["template"]["spec"]["volumes"]
    assert {"name": "l3", "persistentVolumeClaim": {"claimName": "hicache-l3"}} in volumes
    assert prefill["spec"]["replicas"] > 1


def test_images_and_the_dockerfile_pin_the_package_version() -> None:
    """Every container runs the image tagged with the package's version, and the
    Dockerfile installs exactly that version, built from the checkout (no index)."""
    manifests = [m for _, m in render(KUBE)]
    images = {
        c["image"]
        for _, t in _pod_templates(manifests)
        for c in t["spec"]["containers"] + t["spec"].get("initContainers", [])
    }
    assert images == {f"{IMAGE}:{__version__}"}
    dockerfile = (KUBE / "Dockerfile").read_text(encoding="utf-8")
    assert re.findall(r"^ARG HICACHE_EXISTENCE_VERSION=(\S+)$", dockerfile, re.M) == [__version__]
    (base,) = re.findall(r"^ARG SGLANG_IMAGE=(\S+)$", dockerfile, re.M)
    assert not base.endswith(":latest") and ":" in base, base
    assert f"sglang-hicache-existence:{__version__} ." in dockerfile  # the documented tag
    assert "pip wheel" in dockerfile
    assert not re.search(r"pip install[^\n]*[\"' ]hicache-existence", dockerfile)


def test_the_dockerfile_copies_every_input_of_the_build() -> None:
    """The wheel stage copies what the sdist build reads: the package, the benchmark
    suites, the build files and every asset directory setup.py packages."""
    from hicache_existence.commands.assets import SOURCES

    dockerfile = (KUBE / "Dockerfile").read_text(encoding="utf-8")
    copied = {
        item.rstrip("/")
        for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile, re.M)
        for item in line.split()[:-1]
    }
    needed = {
        "pyproject.toml",
        "setup.py",
        "MANIFEST.in",
        "README.md",
        "hicache_existence",
        "benchmarks",
    } | {pattern.split("/")[0] for pattern in SOURCES}
    assert needed <= copied, needed - copied


def test_a_claim_no_manifest_defines_is_found(tmp_path: Path) -> None:
    """The check fails on the manifests as they were (no l3-pvc.yaml): the prefill
    pods' claim hicache-l3 is reported, and so is a missing resource file."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copy)
    kust = copy / "kustomization.yaml"
    kust.write_text(kust.read_text().replace("  - l3-pvc.yaml\n", ""))
    errors = reference_errors([m for _, m in render(copy)])
    assert errors == [
        "StatefulSet sglang-prefill: PersistentVolumeClaim 'hicache-l3' is not defined"
    ]
    (copy / "podmonitor.yaml").unlink()
    with pytest.raises(RenderError, match=r"podmonitor\.yaml is not a file"):
        render(copy)


def test_an_unknown_kustomization_field_is_refused(tmp_path: Path) -> None:
    """A kustomization field the renderer does not implement fails the render instead
    of being ignored (what it would change would go unchecked)."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copy)
    kust = copy / "kustomization.yaml"
    kust.write_text(kust.read_text() + "namePrefix: x-\n")
    with pytest.raises(RenderError, match="namePrefix"):
        render(copy)


def test_the_schemas_reject_a_wrong_field() -> None:
    """The validators are strict: a misspelt field of a core kind and of an operator
    kind, and a rule with both record and alert, are reported."""
    (claim,) = _documents(KUBE / "l3-pvc.yaml")
    claim["spec"]["accesModes"] = claim["spec"].pop("accessModes")
    assert any("accesModes" in e for e in schema_errors(claim))
    (monitor,) = _documents(KUBE / "podmonitor.yaml")
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    assert any("podMetricEndpoints" in e for e in schema_errors(monitor))
    (rule,) = _documents(KUBE / "prometheusrule.yaml")
    rule["spec"]["groups"][0]["rules"][0]["alert"] = "Both"
    assert schema_errors(rule)


def test_kubectl_kustomize_renders_what_the_python_renderer_renders() -> None:
    """The real ``kubectl kustomize`` (run-all.sh installs kubectl where it is
    missing) renders the same objects, field for field, as the renderer the
    offline checks above run on; so the reference and schema checks hold for what
    ``kubectl apply -k`` applies."""
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (run-all.sh installs it)")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBE)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
    ours = [m for _, m in render(KUBE)]

    def key(m: Manifest) -> tuple[str, str]:
        return m["kind"], m["metadata"]["name"]

    assert sorted(map(key, theirs)) == sorted(map(key, ours))
    by_key = {key(m): m for m in ours}
    for m in theirs:
        assert m == by_key[key(m)], key(m)


def _relabelled_job(name: str, namespace: str) -> str:
    """The job label a monitor's relabeling gives a prefill target of ``namespace``."""
    doc = yaml.safe_load((KUBE / name).read_text())
    endpoints = doc["spec"].get("podMetricsEndpoints") or doc["spec"]["endpoints"]
    (rule,) = [r for r in endpoints[0]["relabelings"] if r.get("targetLabel") == "job"]
    kind = "pod" if name.startswith("pod") else "service"
    meta = {
        "__meta_kubernetes_namespace": namespace,
        f"__meta_kubernetes_{kind}_label_app_kubernetes_io_component": "prefill",
    }
    value = rule.get("separator", ";").join(meta[s] for s in rule["sourceLabels"])
    match = re.fullmatch(rule.get("regex", "(.*)"), value)
    assert match is not None, (name, value)
    return match.expand(re.sub(r"\$(\d)", r"\\\1", rule["replacement"]))


@pytest.mark.parametrize("name", ["podmonitor.yaml", "servicemonitor.yaml"])
def test_the_same_manifests_in_two_namespaces_are_two_deployments(name: str, tmp_path) -> None:
    """The rules and alerts take a job for one deployment: the monitors' job keeps
    the namespace, so prod and staging (each with its own L3 claim) are not summed
    into one fleet, and the fleet alert stays quiet for two single instances."""
    import subprocess

    from test_prometheus_rules import promtool

    jobs = {ns: _relabelled_job(name, ns) for ns in ("prod", "staging")}
    assert jobs == {"prod": "prod/sglang-prefill", "staging": "staging/sglang-prefill"}
    series = []
    for ns, job in jobs.items():
        sel = (
            f'job="{job}",namespace="{ns}",instance="10.0.{len(ns)}.1:30000",'
            'model_name="m",engine_type="prefill",storage_backend="file",'
            'tp_rank="0",dp_rank="0",pp_rank="0",pool="kv"'
        )
        for metric, values in (
            ("entries", "1000+0x120"),
            ("capacity_entries", "524288+0x120"),
            ("written_pages_total", "0+600x120"),
            ("redundant_written_pages_total", "0+120x120"),
        ):
            series.append(f"      - series: 'hicache_existence_{metric}{{{sel}}}'")
            series.append(f"        values: '{values}'")
    (tmp_path / "rules.yml").write_bytes((REPO / "integrations/prometheus/rules.yml").read_bytes())
    (tmp_path / "t.yml").write_text(
        "rule_files: [rules.yml]\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n"
        "    input_series:\n" + "\n".join(series) + "\n    alert_rule_test:\n"
        "      - eval_time: 100m\n        alertname: HicacheExistenceFleetRedundantWrites\n"
        "        exp_alerts: []\n"
    )
    out = subprocess.run(
        [promtool(), "test", "rules", "t.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
