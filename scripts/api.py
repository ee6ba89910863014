#!/usr/bin/env python3
"""The public API of the library crates, one line per item, from rustdoc's output.

    cargo doc --workspace --all-features --no-deps
    scripts/api.py --check    # CI: fails when the API differs from docs/api.txt
    scripts/api.py --write    # after a deliberate change: rewrite docs/api.txt

Every item rustdoc documents (all features on) is a line: `crate kind path`, and
below a struct, enum, union or trait its public fields, variants, inherent
methods, associated constants and trait members; re-exports as `crate use ...`.
Trait implementations are not listed. The docs come from $CARGO_TARGET_DIR/doc
(default target/doc).
"""

import difflib
import html
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LISTING = ROOT / "docs" / "api.txt"
CRATES = [
    "pgoutbox",
    "pgoutbox_core",
    "pgoutbox_postgres",
    "pgoutbox_nats",
    "pgoutbox_amqp",
    "pgoutbox_kafka",
    "pgoutbox_sqs",
    "pgoutbox_relay",
]
KINDS = {
    "struct": "struct",
    "enum": "enum",
    "trait": "trait",
    "union": "union",
    "fn": "fn",
    "macro": "macro",
    "type": "type",
    "constant": "const",
    "static": "static",
    "derive": "derive",
    "attr": "attr",
}
MEMBERS = {
    "structfield": "field",
    "variant": "variant",
    "method": "fn",
    "tymethod": "fn",
    "associatedconstant": "const",
    "associatedtype": "type",
}


def strip(text):
    return html.unescape(re.sub(r"<[^>]+>", "", text)).strip()


def members(page, kind):
    """Public members of a struct/enum/union/trait page, without trait impls."""
    if kind == "trait":
        end = len(page)
        for stop in ('id="implementors"', 'id="foreign-impls"', 'id="dyn-compatibility"'):
            at = page.find(stop)
            if at != -1:
                end = min(end, at)
        own = page[:end]
    else:
        # Fields and variants come before every implementation section; the
        # inherent methods are the first section, when there is one.
        sections = [
            page.find(f'<h2 id="{name}"')
            for name in (
                "implementations",
                "trait-implementations",
                "synthetic-implementations",
                "blanket-implementations",
            )
        ]
        first = min([at for at in sections if at != -1], default=len(page))
        own = page[:first]
        if sections[0] != -1:
            after = page.find("<h2 id=", sections[0] + 1)
            own += page[sections[0] : after if after != -1 else len(page)]
    found = set()
    for prefix, name in re.findall(r'id="([a-z]+)\.([A-Za-z0-9_]+)"', own):
        if prefix in MEMBERS:
            found.add(f"{MEMBERS[prefix]} {name}")
    return sorted(found)


def reexports(page):
    return [strip(code) for code in re.findall(r'<dt id="reexport\.[^"]*"><code>(.*?)</code>', page)]


def listing(doc):
    lines = []
    for crate in CRATES:
        base = doc / crate
        all_items = (base / "all.html").read_text()
        for page in sorted(base.rglob("index.html")):
            module = page.parent.relative_to(doc).as_posix().replace("/", "::")
            for use in reexports(page.read_text()):
                lines.append(f"{module} {use}")
        for href, text in re.findall(r'<li><a href="([^"]+)">(.*?)</a></li>', all_items):
            kind = href.rsplit("/", 1)[-1].split(".", 1)[0]
            if kind not in KINDS:
                continue
            path = f"{crate}::{strip(text)}"
            lines.append(f"{path} {KINDS[kind]}")
            if kind in ("struct", "enum", "union", "trait"):
                for member in members((base / href).read_text(), kind):
                    lines.append(f"{path} {member}")
    return sorted(set(lines))


def main():
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    doc = target / "doc"
    if not (doc / "pgoutbox_core" / "all.html").exists():
        sys.exit(f"api: no docs in {doc}: run `cargo doc --workspace --all-features --no-deps` first")
    now = listing(doc)
    text = "".join(line + "\n" for line in now)
    if sys.argv[1:] == ["--write"]:
        LISTING.write_text(text)
        print(f"api: {len(now)} items written to {LISTING.relative_to(ROOT)}")
    elif sys.argv[1:] == ["--check"]:
        recorded = LISTING.read_text().splitlines() if LISTING.exists() else []
        if recorded == now:
            print(f"api: {len(now)} items, as recorded in {LISTING.relative_to(ROOT)}")
            return
        diff = difflib.unified_diff(recorded, now, "docs/api.txt", "the code", lineterm="", n=0)
        print("\n".join(diff))
        sys.exit(
            "api: the public API differs from docs/api.txt (above). If the change is "
            "deliberate, run `scripts/api.py --write` after `cargo doc --workspace "
            "--all-features --no-deps` and commit the listing with the change."
        )
    else:
        counts = {}
        for line in now:
            crate = line.split("::", 1)[0].split(" ", 1)[0]
            counts[crate] = counts.get(crate, 0) + 1
        for crate, n in sorted(counts.items()):
            print(f"{n:6} {crate}")


if __name__ == "__main__":
    main()
