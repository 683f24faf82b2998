#!/usr/bin/env bash
# A method comparison as a Hydra sweep, then its report (table + figures under <sweep>/report/).
#   examples/method_sweep.sh [SWEEP_DIR] [HYDRA_OVERRIDE ...]
# Small sizes so it finishes in minutes on a CPU; drop the size overrides for the experiment's own sizes.
# METHODS and SEEDS pick the sweep's rows, e.g. METHODS=warm,fire_exact SEEDS=0 for a quick look.
set -euo pipefail
SWEEP=${1:-multirun/continual-demo}
shift $(( $# > 0 ? 1 : 0 ))
plasticity-train -m experiment=continual_pretrain +method="${METHODS:-warm,reset,sp,fire_exact}" seed="${SEEDS:-0,1}" \
    phases.code_a_h.steps=100 phases.code_i_r.steps=100 phases.code_s_z.steps=100 \
    model.n_layer=2 model.n_embd=64 model.n_head=2 model.n_kv_head=2 \
    hydra.sweep.dir="$SWEEP" "$@"
# on a cluster: add hydra/launcher=slurm (needs hydra-submitit-launcher), or
# hydra/launcher=parallel (needs the [app] extra's hydra-joblib-launcher) to run the jobs side by side.
plasticity-report "$SWEEP"
