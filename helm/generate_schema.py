"""Writes helm/duet/values.schema.json: the chart's own sections, hand-written in
helm/duet-values.schema.base.json, with `duet:` generated from the cluster config's
pydantic model, so the chart accepts exactly what `ClusterConfig` does.

    .venv/bin/python helm/generate_schema.py          # rewrite the schema
    .venv/bin/python helm/generate_schema.py --check  # exit 1 if it is stale

pydantic emits draft 2020-12 with `$ref: "#/$defs/<Model>"`: its `$defs` move to
the document root, next to the chart's own (lowerCamel names, so they never clash).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cluster.config import ClusterConfig
from cluster.pools import NODE_GROUP_PATTERN

HERE = Path(__file__).resolve().parent
BASE = HERE / "duet-values.schema.base.json"
TARGET = HERE / "duet" / "values.schema.json"


def generate() -> dict:
    schema = json.loads(BASE.read_text())
    duet = ClusterConfig.model_json_schema()
    defs = duet.pop("$defs")
    clash = defs.keys() & schema["$defs"].keys()
    if clash:
        raise SystemExit(f"$defs names in both the base schema and ClusterConfig's: {sorted(clash)}")
    duet["description"] = "The duet cluster config (cluster/config.py ClusterConfig), as in deploy/*.yaml."
    schema["properties"]["duet"] = duet
    # Worker group names and head.nodeGroups become the Ray resource duet/<group>:
    # the same names a pool's node_group accepts.
    schema["$defs"]["nodeGroupName"] = {"type": "string", "pattern": NODE_GROUP_PATTERN}
    schema["$defs"].update(defs)
    return schema


def render() -> str:
    return json.dumps(generate(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if TARGET.read_text() != text:
            print(f"{TARGET} is stale: run python helm/generate_schema.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
