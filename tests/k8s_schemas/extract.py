"""Turns CustomResourceDefinition files into the schemas tests/test_helm.py validates against: for
each served version, its openAPIV3Schema without descriptions (which do not validate anything and
are most of the bytes), as gzipped JSON named <group>_<version>_<kind>.json.gz.
    python tests/k8s_schemas/extract.py CRD.yaml... --out tests/k8s_schemas"""
import argparse
import gzip
import json
import sys
from pathlib import Path

import yaml


def without_descriptions(node):
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crds", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    for path in args.crds:
        crd = yaml.safe_load(path.read_text())
        if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
            print(f"extract: {path} is not a CustomResourceDefinition", file=sys.stderr)
            return 2
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if not version.get("served"):
                continue
            schema = without_descriptions(version["schema"]["openAPIV3Schema"])
            out = args.out / f"{group}_{version['name']}_{kind}.json.gz"
            # mtime 0: the same input gives the same bytes.
            out.write_bytes(gzip.compress(json.dumps(schema, sort_keys=True).encode(), mtime=0))
            print(f"extract: {out} ({group}/{version['name']} {kind})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
