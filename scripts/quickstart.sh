#!/usr/bin/env bash
# pilot-online quickstart: install PILOT's environment and the plugin, patch a PILOT checkout,
# run the CODA smoke config offline (synthetic data, 32 px, random weights, CPU) and print AP/A_T.
#
#   PILOT_ROOT=/path/to/LAMDA-PILOT bash scripts/quickstart.sh
#
# Without PILOT_ROOT it patches .pilot/ (ignored by git), filled once with a copy of
# ../shared/LAMDA-PILOT when that exists (offline), else with a clone of LAMDA-PILOT at the pinned
# commit when the network allows. ../shared/LAMDA-PILOT itself is never patched, even when named
# by PILOT_ROOT. The patches are reversible: `pilot-online setup --revert "$PILOT_ROOT"`.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
PILOT_COMMIT=5240714
CONFIG=${CONFIG:-smoke_coda_online.json}

echo "== installing the plugin and PILOT's dependencies (registry torch + torchvision, timm 0.6.13)"
"$PYTHON" -m pip install -q -e ".[pilot,test,plots,ray,tensorboard]"

SHARED_PILOT="$REPO/../shared/LAMDA-PILOT"
if [ -n "${PILOT_ROOT:-}" ] && [ -d "$SHARED_PILOT" ] && [ -d "$PILOT_ROOT" ] \
    && [ "$(cd "$PILOT_ROOT" && pwd -P)" = "$(cd "$SHARED_PILOT" && pwd -P)" ]; then
    echo "== PILOT_ROOT is the shared pristine LAMDA-PILOT: patching a copy in .pilot/ instead"
    PILOT_ROOT=
fi
if [ -z "${PILOT_ROOT:-}" ]; then
    PILOT_ROOT="$REPO/.pilot"
    if [ ! -f "$PILOT_ROOT/main.py" ]; then
        rm -rf "$PILOT_ROOT"
        if [ -f "$SHARED_PILOT/main.py" ]; then
            # Patch a copy: the shared tree stays pristine for everyone else (and may be read-only).
            echo "== PILOT_ROOT is not set: copying $(cd "$SHARED_PILOT" && pwd) into $PILOT_ROOT"
            cp -R "$SHARED_PILOT" "$PILOT_ROOT"
            chmod -R u+w "$PILOT_ROOT"
        else
            echo "== PILOT_ROOT is not set: cloning LAMDA-PILOT@$PILOT_COMMIT into $PILOT_ROOT"
            if ! git clone -q https://github.com/LAMDA-CL/LAMDA-PILOT "$PILOT_ROOT"; then
                rm -rf "$PILOT_ROOT"
                echo "quickstart: could not clone LAMDA-PILOT (no network?) and found no" \
                    "../shared/LAMDA-PILOT beside the repo." >&2
                echo "  Set PILOT_ROOT to a LAMDA-PILOT checkout at commit $PILOT_COMMIT and rerun." >&2
                exit 2
            fi
            git -C "$PILOT_ROOT" checkout -q "$PILOT_COMMIT"
        fi
    fi
fi
PILOT_ROOT=$(cd "$PILOT_ROOT" && pwd)
echo "== patching $PILOT_ROOT"
pilot-online setup "$PILOT_ROOT"

echo "== running exps/$CONFIG through PILOT's main.py (offline)"
cd "$PILOT_ROOT"
"$PYTHON" main.py --config "exps/$CONFIG"
cd "$REPO"
echo
echo "== results (every smoke run in $PILOT_ROOT/logs)"
pilot-online report "$PILOT_ROOT"/logs/*/synthetic_small
