#!/usr/bin/env python3
"""Honest MSRV: each workspace crate's `rust-version` must equal the highest
`rust-version` among the packages it builds with by default (its normal and
build dependencies, transitively, as locked). Reads `cargo metadata`; prints one
line per crate, with what every feature together needs (e.g. the umbrella
crate's `sqs` feature brings the AWS SDK: the README says so); exits 1 when a
declared version is lower than a default dependency's, or higher than every
one's (then lower it, or say in the manifest why). The crate's own use of newer
std APIs is checked by clippy's `incompatible_msrv` lint, which reads the same
`rust-version`.

    scripts/msrv-check.py        # as .ci/run does
"""
import json
import subprocess
import sys


def version_key(text):
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def metadata(*flags):
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", *flags,
         "--filter-platform", "x86_64-unknown-linux-gnu"],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)


def requirements(meta):
    """Per workspace crate name: (highest rust-version, the package that has it)."""
    packages = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    members = set(meta["workspace_members"])
    result = {}
    for member in members:
        seen, stack = set(), [member]
        while stack:
            node = nodes[stack.pop()]
            for dep in node["deps"]:
                kinds = {k["kind"] for k in dep["dep_kinds"]}
                if kinds & {None, "build"} and dep["pkg"] not in seen:
                    seen.add(dep["pkg"])
                    stack.append(dep["pkg"])
        needs = [(packages[d]["rust_version"], packages[d]["name"])
                 for d in seen if packages[d].get("rust_version") and d not in members]
        result[packages[member]["name"]] = (
            max(needs, key=lambda n: version_key(n[0])) if needs else ("none", "-"),
            packages[member].get("rust_version") or "none",
        )
    return result


def main():
    default = requirements(metadata())
    every = requirements(metadata("--all-features"))
    failed = False
    for name in sorted(default):
        (top, by), declared = default[name]
        (all_top, all_by), _ = every[name]
        if declared == "none" or top == "none":
            verdict = "ok" if top == "none" else "MISSING"
        elif version_key(declared) < version_key(top):
            verdict = "TOO LOW"
        elif version_key(declared) > version_key(top):
            verdict = "HIGHER THAN ANY DEPENDENCY NEEDS"
        else:
            verdict = "ok"
        print(f"msrv: {name}: declares {declared}, default dependencies need {top} ({by}): "
              f"{verdict}; with every feature {all_top} ({all_by})")
        failed |= verdict != "ok"
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
