#!/usr/bin/env bash
# A method comparison as a Hydra sweep, then its report (table + figures under <sweep>/report/).
# Small sizes so it finishes in minutes on a CPU; drop the overrides for the experiment's own sizes.
set -euo pipefail
SWEEP=${1:-multirun/continual-demo}
plasticity-train -m experiment=continual_pretrain +method=warm,reset,sp,fire_exact seed=0,1 \
    phases.code_a_h.steps=100 phases.code_i_r.steps=100 phases.code_s_z.steps=100 \
    model.n_layer=2 model.n_embd=64 model.n_head=2 model.n_kv_head=2 \
    hydra.sweep.dir="$SWEEP"
# on a cluster: add hydra/launcher=slurm (needs hydra-submitit-launcher), or
# hydra/launcher=parallel (needs hydra-joblib-launcher) to run the jobs side by side.
plasticity-report "$SWEEP"
