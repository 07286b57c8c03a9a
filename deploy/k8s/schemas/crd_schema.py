"""Writes one version's OpenAPI schema of a CustomResourceDefinition as the JSON file that
tests/test_deploy.py validates that custom resource against (kubernetes-validate knows no CRDs).

    python deploy/k8s/schemas/crd_schema.py CRD.yaml VERSION OUT.json --source "WHERE THE CRD CAME FROM"

The schema is the CRD's `openAPIV3Schema` as published, less its `description` fields (most of
its size, and they validate nothing); `$comment` records the source. The test adds what the API
server's strict field validation adds: an object that lists its properties takes no others.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def without_descriptions(node):
    if isinstance(node, dict):
        return {key: without_descriptions(value) for key, value in node.items() if key != "description"}
    if isinstance(node, list):
        return [without_descriptions(value) for value in node]
    return node


def version_schema(crd: dict, version: str) -> dict:
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    names = [entry["name"] for entry in crd["spec"]["versions"]]
    raise SystemExit(f"{crd['metadata']['name']} has no version {version!r} (it has {names})")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("crd", type=Path, help="the CustomResourceDefinition's YAML")
    parser.add_argument("version", help="its version to write, e.g. v1")
    parser.add_argument("out", type=Path, help="the JSON schema to write")
    parser.add_argument("--source", required=True, help="where the CRD came from (repository, tag, path)")
    args = parser.parse_args(argv)
    crd = yaml.safe_load(args.crd.read_text())
    schema = {"$comment": f"{crd['metadata']['name']} {args.version}: the openAPIV3Schema of {args.source}, "
                          f"descriptions removed (deploy/k8s/schemas/crd_schema.py)",
              **without_descriptions(version_schema(crd, args.version))}
    args.out.write_text(json.dumps(schema, indent=0, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
