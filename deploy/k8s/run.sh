#!/bin/bash
# Run the shards, wait for them, then the merge; print the merged verdict and exit with it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Wait until job $1 is Complete or Failed (a divergence fails the merge job: `kubectl wait` for
# Complete alone would wait forever); Complete or Failed on stdout.
wait_job() {
    local s
    while :; do
        s=$(kubectl get job "$1" -o jsonpath='{.status.conditions[?(@.status=="True")].type}')
        case "$s" in *Complete*) echo Complete; return ;; *Failed*) echo Failed; return ;; esac
        sleep 10
    done
}
kubectl delete job mla-diff-shards mla-diff-merge --ignore-not-found
kubectl apply -f "$here/shards.yaml"
if [ "$(wait_job mla-diff-shards)" != Complete ]; then
    kubectl logs job/mla-diff-shards --all-containers --prefix >&2 || true
    echo "mla-diff: a shard failed (see above)" >&2
    exit 2
fi
kubectl apply -f "$here/merge.yaml"
wait_job mla-diff-merge >/dev/null
kubectl logs job/mla-diff-merge
exit "$(kubectl get pod -l job-name=mla-diff-merge -o jsonpath='{.items[0].status.containerStatuses[0].state.terminated.exitCode}')"
