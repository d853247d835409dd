#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Lists the names a program gets from one of amp's public headers.

Follows the header's <amp/...> includes, and lists every type, function,
variable and alias declared at namespace scope in `amp` or `amp::optim`
(amp::internal and amp::detail hold what programs never name). With --max N
it exits 1 when there are more than N. Run from the repository root:

  python3 tools/public_api.py amp/amp.h --max 40

A family counts as one name: the names of one header that differ only by
a trailing number (the levels O0, O1, ...), or CamelCase types of one header
that share their first word (FusedAdam, FusedAdamW, FusedSGD), so that adding
a member of a family does not grow the count.

A reading of the declarations, not a compiler: headers keep one
declaration per statement, as they do now.
"""
import argparse
import os
import re
import sys

ROOTS = ["amp/include", "opt_levels/include"]
PUBLIC = {"amp", "amp::optim"}
INCLUDE = re.compile(r"^\s*#\s*include\s+<(amp/[^>]+)>", re.M)
TOKEN = re.compile(r"namespace\s+([\w:]+)\s*\{|\{|\}|;")
TYPE = re.compile(r"(?:class|struct|enum\s+class|enum)\s+(?:\[\[\w+\]\]\s+)?(\w+)\s*(?:final\s*)?(?::[^{;]*)?$")
ALIAS = re.compile(r"\busing\s+(\w+)\s*=")
VARIABLE = re.compile(r"\b(?:constexpr|const)\s+[\w:<>, ]+?\s+(\w+)\s*=")
FUNCTION = re.compile(r"(\w+)\s*\((?:[^()]|\([^()]*\))*\)\s*(?:const\s*)?(?:noexcept\s*)?(?:->\s*[\w:<>]+\s*)?$")
NOT_FUNCTIONS = {"operator", "decltype", "static_assert", "sizeof", "if", "for", "while", "return"}


def resolve(header, root):
    for base in ROOTS:
        path = os.path.join(root, base, header)
        if os.path.exists(path):
            return path
    raise SystemExit(f"public_api: <{header}> not found under {ROOTS}")


def headers_of(start, root):
    seen, pending = [], [start]
    while pending:
        header = pending.pop()
        if header not in seen:
            seen.append(header)
            with open(resolve(header, root), encoding="utf-8") as f:
                pending.extend(INCLUDE.findall(f.read()))
    return seen


def declared(text):
    """(scope, name) for each declaration at namespace scope in `text`."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"^\s*#[^\n]*", "", text, flags=re.M)
    scopes = []  # a namespace's name, or None for any other brace
    start = 0
    for token in TOKEN.finditer(text):
        statement = " ".join(text[start:token.start()].split())
        start = token.end()
        in_namespaces = all(s is not None for s in scopes)
        scope = "::".join(scopes) if in_namespaces else None
        if token.group(1):
            scopes.append(token.group(1))
            continue
        if scope is not None and statement and not statement.startswith("template <>"):
            statement = re.sub(r"^template\s*<[^;{]*?>\s*", "", statement)
            for pattern in (TYPE, ALIAS, VARIABLE, FUNCTION):
                m = pattern.search(statement)
                if m and (pattern is not TYPE or token.group(0) == "{"):
                    if m.group(1) not in NOT_FUNCTIONS and not statement.startswith(("friend", "return")):
                        yield scope, m.group(1)
                    break
        if token.group(0) == "{":
            scopes.append(None)
        elif token.group(0) == "}" and scopes:
            scopes.pop()


def family_of(name, header, names):
    """The family `name` belongs to among the `names` of its `header`."""
    scope, _, short = name.rpartition("::")
    numbered = re.fullmatch(r"([A-Za-z_]+?)\d+", short)
    if numbered:
        return f"{scope}::{numbered.group(1)}<n>"
    word = re.match(r"[A-Z][a-z]+(?=[A-Z])", short)
    if word:
        kin = [n for n, h in names.items() if h == header and n.rpartition("::")[2].startswith(word.group(0))
               and n.rpartition("::")[0] == scope]
        if len(kin) > 1:
            return f"{scope}::{word.group(0)}*"
    return name


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("header", help="e.g. amp/amp.h")
    parser.add_argument("--max", type=int, help="fail when there are more names than this")
    parser.add_argument("--root", default=".", help="the repository root")
    args = parser.parse_args()
    names = {}
    for header in headers_of(args.header, args.root):
        with open(resolve(header, args.root), encoding="utf-8") as f:
            for scope, name in declared(f.read()):
                if scope in PUBLIC:
                    names.setdefault(f"{scope}::{name}", header)
    families = {}
    for name, header in names.items():
        families.setdefault((header, family_of(name, header, names)), []).append(name)
    for (header, family), members in sorted(families.items()):
        shown = family if len(members) == 1 else f"{family} ({', '.join(sorted(members))})"
        print(f"{header:28} {shown}")
    print(f"public_api: {len(families)} names reachable from <{args.header}> ({len(names)} with each family's members)")
    if args.max is not None and len(families) > args.max:
        print(f"public_api: more than {args.max}; move what programs need less to another umbrella "
              "header, or what they never name to amp::internal", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
