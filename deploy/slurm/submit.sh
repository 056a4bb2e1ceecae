#!/bin/bash
# Queue an mla-diff run as a Slurm job array of SHARDS shards and its merge:
#   MODEL=/shared/model.gguf SHARDS=4 MLA_DIFF_ARGS='--mode shadow' deploy/slurm/submit.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${MODEL:?set MODEL}"
export SHARDS=${SHARDS:-4} REPORTS=${REPORTS:-$PWD/mla-diff-reports}
export MODEL MLA_DIFF_ARGS=${MLA_DIFF_ARGS:-}
array=$(sbatch --parsable --export=ALL --array=0-$((SHARDS - 1)) "$here/shard.sbatch")
sbatch --parsable --export=ALL --dependency=afterok:"${array%%;*}" "$here/merge.sbatch"
