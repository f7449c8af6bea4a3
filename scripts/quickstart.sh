#!/usr/bin/env bash
# pilot-online quickstart: install what a run needs, patch a PILOT checkout, run CODA and
# CODA + P + FGH through PILOT's main.py on Split Fashion-MNIST with the shipped scale-model ViT
# (pretrained here, 5 blocks, 32 px; CPU, offline, a few minutes on 2 cores), print both rows.
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

echo "== installing the plugin and what a run needs (torch, torchvision, timm 0.6.13, safetensors)"
"$PYTHON" -m pip install -q -e ".[pilot,safetensors]"

# Fashion-MNIST: Debian's package puts the four IDX files in /usr/share/datasets/fashion-mnist.
FIND_DATA="from pilot_online.core.fashion_mnist import find_folder; find_folder()"
if ! "$PYTHON" -c "$FIND_DATA" >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    if command -v apt-get >/dev/null; then
        echo "== installing Fashion-MNIST (Debian's dataset-fashion-mnist)"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
    else
        "$PYTHON" -c "$FIND_DATA" 2>&1 | tail -1 >&2
        exit 2
    fi
fi

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

start=$SECONDS
cd "$PILOT_ROOT"
for VARIANT in base fgh; do
    echo "== running exps/quickstart_coda_online_$VARIANT.json through PILOT's main.py"
    "$PYTHON" main.py --config "exps/quickstart_coda_online_$VARIANT.json"
done
cd "$REPO"
echo
pilot-online report "$PILOT_ROOT"/logs/coda_online/fashion_mnist_quick
echo
echo "What the rows are: CODA-Prompt trained online, one pass over Split Fashion-MNIST (5 tasks"
echo "of 2 classes, batch 100, Adam at 5e-3), no memory of past images: base, and + P + FGH"
echo "(online prototypes replayed through the head; Fine-Grained Hypergradients). AP is the"
echo "paper's metric: the mean over task ends of the accuracy on the tasks seen so far; A_T is"
echo "the accuracy over all 10 classes at the end. The paper's ablation predicts + P + FGH above"
echo "base (CODA, Si-Blurry CIFAR-100, 5e-3: 71.1 -> 79.5). One seed says little: pilot-online"
echo "scale-model runs the ablation on this backbone, three seeds a cell, and writes a verdict for"
echo "each of the paper's claims into docs/scale-model.md."
echo "quickstart: the two runs took $((SECONDS - start)) s"
