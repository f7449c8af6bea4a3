#!/usr/bin/env bash
# The paper's evaluation protocol at smoke scale, end to end, on the CPU in minutes: the hp_grid
# search (two methods, two learning rates, the paper configs' gamma 1, two seeds), best.json,
# the Best HP column on both streams, the fixed-LR Si-Blurry column, the Si-Blurry ablation rows
# and a gamma sweep; then
# one command writes Tables 1-2, A_T, the ablation, per-task and time tables (Markdown + LaTeX)
# and the five figures. Tiny synthetic data, 32 px, random weights: the numbers mean nothing, the
# plumbing is what is shown. The same commands at full scale are in the README ("Reproducing the
# paper's tables").
#
#   PILOT_ROOT=/path/to/patched/LAMDA-PILOT bash scripts/protocol_smoke.sh [OUT] [ENGINE FLAGS...]
#   e.g. bash scripts/protocol_smoke.sh runs/protocol_smoke --jobs 2
set -euo pipefail
cd "$(dirname "$0")/.."
: "${PILOT_ROOT:?set PILOT_ROOT to a LAMDA-PILOT checkout patched by pilot-online setup}"
OUT=${1:-runs/protocol_smoke}
shift || true
ENGINE=("$@")
METHODS=${METHODS:-coda,linear_probe}
T='exps/smoke_{method}_online.json'
S=(--set dataset=synthetic_tiny --set init_cls=2 --set increment=2 --set batch_size=20
    --set eval_period=40 --set 'seed=[1993,1994]')
sweep() { pilot-online sweep --pilot-root "$PILOT_ROOT" "${ENGINE[@]}" "$@"; }

start=$SECONDS
# 1. The search (clear, as the paper's VTAB search), at the two fixed LRs: it doubles as their
#    clear columns. 2. best.json. 3. The Best HP column, both streams.
sweep --preset hp_grid --methods "$METHODS" --config "$T" "${S[@]}" \
    --grid init_lr=5e-5,5e-3 --grid fgh.gamma=1 --out "$OUT/hp_grid"
pilot-online best "$OUT/hp_grid" --out "$OUT/best.json"
sweep --hp-from "$OUT/best.json" --config "$T" "${S[@]}" --grid stream=clear,si_blurry \
    --out "$OUT/best_hp"
# 4. The fixed-LR Si-Blurry columns with the ablation rows (base, + P, + FGH, + P + FGH).
sweep --config "$T" --methods "$METHODS" "${S[@]}" --grid stream=si_blurry \
    --grid variant=base,p,fgh_only,fgh --grid init_lr=5e-5,5e-3 --out "$OUT/blurry"
# 5. Figure 3: gamma sensitivity of the first method's + ours row (clear, 5e-3).
sweep --config "$T" --methods "${METHODS%%,*}" "${S[@]}" --grid variant=fgh \
    --grid fgh.gamma=0.1,10 --grid init_lr=5e-3 --out "$OUT/gamma"
# 6. One command: every table and the five figures, from the results folders (the gamma runs
#    only feed Fig. 3; the tables leave them out and say so in their notes).
pilot-online tables "$OUT/hp_grid" "$OUT/best_hp" "$OUT/blurry" "$OUT/gamma" --out "$OUT/tables" \
    --figures
echo "protocol smoke: $((SECONDS - start)) s; tables and figures in $OUT/tables"
