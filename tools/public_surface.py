#!/usr/bin/env python3
"""Checks tollgate's public surface from its rustdoc output (built with every
user-facing feature): the crate root lists at most MAX_ROOT items, and every
public item has one path (a name under two paths must be two different
items, listed in DIFFERENT_ITEMS_ONE_NAME with the reason).

Usage: tools/public_surface.py target/doc/tollgate
"""
import collections
import re
import sys

MAX_ROOT = 35
# Same name, different types: each layer's service future.
DIFFERENT_ITEMS_ONE_NAME = {"ResponseFuture"}


def main(doc_dir):
    index = open(f"{doc_dir}/index.html", encoding="utf-8").read()
    # The item's own link, not the feature badge docs.rs adds beside it.
    root = [
        re.sub("<[^>]+>", "", re.search(r"<a [^>]*>(.*?)</a>", item).group(1))
        for item in re.findall(r"<dt>(.*?)</dt>", index)
    ]
    print(f"crate root: {len(root)} items: {', '.join(root)}")
    failures = []
    if len(root) > MAX_ROOT:
        failures.append(f"the crate root lists {len(root)} items, more than {MAX_ROOT}")
    everything = open(f"{doc_dir}/all.html", encoding="utf-8").read()
    paths = re.findall(r'<li><a href="[^"]+">([^<]+)</a></li>', everything)
    by_name = collections.defaultdict(list)
    for path in paths:
        by_name[path.split("::")[-1]].append(path)
    for name, found in sorted(by_name.items()):
        if len(found) > 1 and name not in DIFFERENT_ITEMS_ONE_NAME:
            failures.append(f"{name} has {len(found)} paths: {', '.join(found)}")
    print(f"{len(paths)} public items in all")
    for failure in failures:
        print(f"FAIL: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "target/doc/tollgate"))
