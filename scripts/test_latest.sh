#!/usr/bin/env bash
# `make test-latest`: triode with the newest releases that pyproject.toml's ranges admit, in a
# throwaway venv, to see an upstream release break us before a user does. It prints which
# versions differ from requirements.lock, then runs a quick subset: the install checks (every
# module imports, one top-level name), the unit tests, one contract test on the default model and
# one HTTP round trip. torch stays at the lock's CPU build, as in every install here.
#
#     bash scripts/test_latest.sh          # LATEST_VENV=/path keeps the venv for a second look
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LATEST_VENV:-$(mktemp -d)/venv}
python=${PYTHON:-python3}
torch_pin=$(grep -E '^torch==' requirements.lock)

echo "== a fresh venv in $venv with the newest admitted releases ($torch_pin kept)"
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "$torch_pin"
"$venv/bin/python" -m pip install --quiet --upgrade --upgrade-strategy eager --editable '.[bench,test]'

echo "== versions that differ from requirements.lock"
"$venv/bin/python" scripts/check_lock.py --compare-installed

echo "== the quick subset"
mapfile -t unit_tests < <(grep -lE '^"""(Unit tests|unit:)' tests/test_*.py)
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "${unit_tests[@]}" \
    "tests/test_engine_contract.py::test_llm_generate_matches_hf" \
    "tests/test_http_deploy.py::test_hypercorn_trio_worker_serves_the_app"
