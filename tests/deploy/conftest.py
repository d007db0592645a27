"""Fixtures of the deployment-file tests."""

from __future__ import annotations

import pytest
from deploy_files import K8S, yaml_documents


@pytest.fixture(scope="session")
def k8s_objects() -> list[dict]:
    """Every Kubernetes object under deploy/k8s (kustomization.yaml aside)."""
    objects = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml_documents(path):
            if doc.get("kind") != "Kustomization":
                objects.append(doc)
    return objects
