"""deploy/kubernetes checked against the Kubernetes API schemas, offline (kubernetes-validate
ships them): every manifest is a valid object of its kind, strictly (an unknown or misspelt
field is an error, where the API server would drop it silently), for the newest Kubernetes
release the library knows and the oldest one the README supports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# The oldest release with every API the manifests use (batch/v1 Job ttlSecondsAfterFinished,
# autoscaling/v2, policy/v1): clusters older than this are out of support upstream too.
OLDEST = "1.29.0"
VERSIONS = (OLDEST, kubernetes_validate.latest_version())


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object of deploy/kubernetes (kustomization.yaml is kustomize's own
    file, and helm/ holds chart values, not objects)."""
    found = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return found


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("where", "doc"), manifests(), ids=[w for w, _ in manifests()])
def test_every_manifest_is_a_valid_kubernetes_object(where: str, doc: dict[str, Any], version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_lists_existing_manifests_and_every_manifest_is_listed_or_a_template():
    """`kubectl apply -k` finds every resource it names; a manifest it leaves out is one the
    kustomization says is left out on purpose (a template, an optional one)."""
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert all((KUBERNETES / name).is_file() for name in listed), listed
    text = (KUBERNETES / "kustomization.yaml").read_text()
    for path in KUBERNETES.glob("*.yaml"):
        if path.name != "kustomization.yaml" and path.name not in listed:
            assert path.name in text, f"{path.name} is neither listed nor named as left out"


def test_a_misspelt_field_is_caught():
    """The check is strict: a Deployment whose container says `comand` fails."""
    (doc,) = [d for w, d in manifests() if w == "sources.yaml:Deployment/kbmesh-sources"]
    broken = yaml.safe_load(yaml.safe_dump(doc))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["comand"] = container.pop("command")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
