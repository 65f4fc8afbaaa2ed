#!/usr/bin/env bash
# The linter and the type checker, as `make test` runs them: ruff over the tree, then mypy over
# a tree of links laid out as installed (dcptool/cli, dcptool/protocol, ...: the top-level
# folders are dcptool.* only through pyproject's package-dir). Configuration: pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VENV_PY:-.venv/bin/python}
"$PY" -m ruff check --quiet .
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/dcptool"
cp dcptool/__init__.py "$tree/dcptool/"
for d in cli capture live serve restore protocol replay; do ln -s "$PWD/$d" "$tree/dcptool/$d"; done
cd "$tree" && "$OLDPWD/$PY" -m mypy --config-file "$OLDPWD/pyproject.toml" --python-executable "$OLDPWD/$PY" \
    --cache-dir "$OLDPWD/build/mypy-cache" -p dcptool
