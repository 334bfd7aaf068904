#!/usr/bin/env bash
# The GPU engine stack as an offline wheelhouse (scripts/wheelhouse.py says how):
#   scripts/wheelhouse.sh build --torch 2.11 --cuda 13 [--python 3.12] [--split-mib 40] DIR   # with PyPI
#   scripts/wheelhouse.sh install DIR [DIR ...]                                                 # on the node
#   scripts/wheelhouse.sh verify DIR [DIR ...]
# Standard library only: the node's python3 runs it (PYTHON picks another).
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/wheelhouse.py" "$@"
