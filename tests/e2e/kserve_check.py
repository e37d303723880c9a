"""``python -m tests.e2e.kserve_check MODEL < document.json``: check a KServe resource against
the KServe SDK's generated models (from the CRD OpenAPI), as the API server's schema validation
would: unknown fields and wrong types fail. Prints what is wrong and exits 1, or prints nothing.

A process of its own: the SDK registers the same protobuf names as tritonclient.grpc, which the
test process imports.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def check(data: Any, model: type, path: str = "") -> None:
    """Check a manifest against the KServe SDK's generated models (from the CRD OpenAPI):
    unknown fields and wrong types fail, as the API server's schema validation would."""
    import kserve.models
    import kubernetes.client.models

    if not isinstance(data, dict):
        raise AssertionError(f"{path}: expected an object for {model.__name__}")
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, value in data.items():
        assert key in by_json, f"{path}.{key}: not a field of {model.__name__}"
        kind = model.openapi_types[by_json[key]]
        value_check(value, kind, f"{path}.{key}", kserve.models, kubernetes.client.models)


def value_check(value: Any, kind: str, path: str, *modules: Any) -> None:
    if kind.startswith(("list[", "List[")):
        assert isinstance(value, list), f"{path}: expected a list"
        for i, item in enumerate(value):
            value_check(item, kind[5:-1], f"{path}[{i}]", *modules)
    elif kind.startswith(("dict(", "Dict[")):
        assert isinstance(value, dict), f"{path}: expected a mapping"
    elif kind in ("str", "int", "bool", "float", "object"):
        expected = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}[
            kind
        ]
        assert isinstance(value, expected), f"{path}: expected {kind}, got {value!r}"
    else:
        model = next((getattr(m, kind) for m in modules if hasattr(m, kind)), None)
        assert model is not None, f"{path}: no model class {kind}"
        check(value, model, path)


def main() -> int:
    import kserve.models

    document = json.load(sys.stdin)
    try:
        check(document, getattr(kserve.models, sys.argv[1]), sys.argv[1])
    except AssertionError as exc:
        print(exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
