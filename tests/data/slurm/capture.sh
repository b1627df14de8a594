#!/usr/bin/env bash
# Records what the real scheduler prints, for the parsing tests (tests/unit/backends/test_slurm_parsing.py).
# Needs the cluster from deploy/slurm/up.sh (two nodes with 4 CPUs each) and nothing else running;
# takes about two minutes (one job must run into its time limit). Rewrites the *.txt beside it.
#
#   tests/data/slurm/capture.sh
#
# Not made here: *_node_lost.txt, *_batch_host_lost.txt, sinfo_nodes_*.txt and squeue_nodelist_resized.txt
# were recorded on a 3-node cluster (up.sh --nodes 3) by the lost-node experiments of docs/slurm.md
# ("Lost nodes"): sbatch --nodes=3 --no-kill, then scontrol update nodename=nX state=down mid-step.
set -euo pipefail
cd "$(dirname "$0")"
SQUEUE_FMT='JobArrayID:|,State:|,Reason:|,exit_code:|,RestartCnt:|,NodeList:|,StartTime:|,BatchHost:'  # as the backend asks
SACCT_FMT='JobID,State,ExitCode,Reason,NodeList'  # as the backend asks
submit() { sbatch --parsable -o /dev/null -e /dev/null "$@"; }
state_of() { sacct -n -P -X -j "$1" -o State | head -n1; }
wait_state() {  # wait_state ID WORD: until sacct shows WORD for ID (60 s at most)
  for _ in $(seq 300); do [[ $(state_of "$1") == "$2"* ]] && return 0; sleep 0.2; done
  echo "job $1 never reached $2 (is $(state_of "$1"))" >&2; return 1
}

[ -z "$(squeue -h)" ] || { echo "the queue must be empty first" >&2; exit 1; }

# Finished jobs: completed, failed, a running and a pending job cancelled, a small array.
done_ok=$(submit -n1 --wrap true)
failed=$(submit -n1 --wrap 'exit 3')
killed=$(submit -n1 --wrap 'sleep 300')
# shellcheck disable=SC2016  # expanded by the job, not here
array_done=$(submit -n1 --array=0-2 --wrap 'exit $SLURM_ARRAY_TASK_ID')
timeout=$(submit -n1 -t 1 --wrap 'sleep 300')
wait_state "$killed" RUNNING
scancel "$killed"

# Fill both nodes (8 CPUs), so that what follows must wait.
sleep 2
full=$(submit -N2 --ntasks-per-node=3 -t 5 --wrap 'sleep 300')  # -t: the waiting jobs get an estimate
wait_state "$full" RUNNING
resources=$(submit -N2 --ntasks-per-node=2 --wrap 'sleep 1')
priority=$(submit -N2 --ntasks-per-node=2 --wrap 'sleep 1')
held=$(submit -n1 --hold --wrap 'sleep 1')
dependent=$(submit -n1 --dependency="afterok:$full" --wrap 'sleep 1')
array_pending=$(submit -N2 --ntasks-per-node=2 --array=0-3 --wrap 'sleep 1')
cancelled_pending=$(submit -n1 --hold --wrap 'sleep 1')
scancel "$cancelled_pending"
sleep 4  # one scheduler pass (sched_interval=2) to set the pending reasons

# The scheduler's start estimate for jobs waiting behind the one that fills the cluster.
squeue -h -t all -r -O "$SQUEUE_FMT" -j "$full,$resources,$priority,$held" >squeue_start_estimate.txt

ids="$done_ok,$failed,$killed,$array_done,$timeout,$full,$resources,$priority,$held,$dependent,$array_pending,$cancelled_pending"
squeue -h -t all -O "$SQUEUE_FMT" -j "$ids" >squeue_mixed.txt
squeue -h -t all -r -O "$SQUEUE_FMT" -j "$ids" >squeue_mixed_array_expanded.txt
sacct -n -P -X -o "$SACCT_FMT" -j "$ids" >sacct_mixed.txt

# A suspended job and a requeued one.
scontrol suspend "$full"
sleep 1
sacct -n -P -X -o "$SACCT_FMT" -j "$full" >sacct_suspended.txt
squeue -h -t all -r -O "$SQUEUE_FMT" -j "$full" >squeue_suspended.txt
scontrol resume "$full"
scontrol requeue "$full"
squeue -h -t all -r -O "$SQUEUE_FMT" -j "$full" >squeue_requeuing.txt
sleep 1
sacct -n -P -X -o "$SACCT_FMT" -j "$full" >sacct_requeued.txt
squeue -h -t all -r -O "$SQUEUE_FMT" -j "$full" >squeue_requeued.txt
scancel "$full" "$held" "$dependent" "$resources" "$priority" "$array_pending"

# A node that fails under a running job.
node_fail=$(submit -N2 --ntasks-per-node=1 --no-requeue --wrap 'sleep 300')
wait_state "$node_fail" RUNNING
scontrol update nodename=n2 state=down reason=capture
wait_state "$node_fail" NODE_FAIL
# ReturnToService=2 may have brought it back already; then resume is refused.
scontrol update nodename=n2 state=resume 2>/dev/null || true

wait_state "$timeout" TIMEOUT
sleep 1
sacct -n -P -X -o "$SACCT_FMT" -j "$ids,$node_fail" >sacct_final.txt
# Ended jobs stay in squeue for MinJobAge (300 s), with their raw exit status; an id it never knew.
squeue -h -t all -r -O "$SQUEUE_FMT" -j "$ids,$node_fail" >squeue_final.txt
{ squeue -h -t all -r -O "$SQUEUE_FMT" -j 999999 2>&1 || echo "exit=$?"; } >squeue_unknown.txt

# Jobs found again by the script path SLURM keeps as their command (staged submissions, slurm_submit.py):
# a held array, a held single job, one cancelled, and a --wrap job (no script).
scripts=$(mktemp -d)
for token in 0123456789abcdef0123456789abcdef fedcba9876543210fedcba9876543210 00000000000000000000000000000000; do
  printf '#!/bin/bash\nsleep 1\n' >"$scripts/.submission_file_$token.sh"
done
staged_array=$(submit --hold --array=0-2 "$scripts/.submission_file_0123456789abcdef0123456789abcdef.sh")
staged_single=$(submit --hold "$scripts/.submission_file_fedcba9876543210fedcba9876543210.sh")
staged_cancelled=$(submit --hold "$scripts/.submission_file_00000000000000000000000000000000.sh")
wrapped=$(submit --hold --wrap true)
scancel "$staged_cancelled"
squeue --me -h -t all -r -O 'JobArrayID:|,State:|,Command:' \
  -j "$staged_array,$staged_single,$staged_cancelled,$wrapped" >squeue_submissions.txt
scancel "$staged_array" "$staged_single" "$wrapped"
rm -r "$scripts"

# What the controller says about limits and refusals.
scontrol show config | grep -E '^(MaxArraySize|MaxJobCount|ClusterName|SLURM_VERSION) ' >scontrol_show_config.txt
scontrol show partition -o >scontrol_show_partition.txt
{ sbatch --test-only -N3 -o /dev/null --wrap true 2>&1 || echo "exit=$?"; } >sbatch_too_many_nodes.txt
{ sbatch --test-only -p nosuch -o /dev/null --wrap true 2>&1 || echo "exit=$?"; } >sbatch_bad_partition.txt
{ sbatch --test-only -t 2000 -o /dev/null --wrap true 2>&1 || echo "exit=$?"; } >sbatch_time_over_limit.txt
{ sbatch --test-only -N1 --ntasks-per-node=9 -o /dev/null --wrap true 2>&1 || echo "exit=$?"; } \
  >sbatch_too_many_tasks.txt
{ sbatch --test-only -N2 --ntasks-per-node=2 -o /dev/null --wrap true 2>&1 || echo "exit=$?"; } >sbatch_test_ok.txt
{ sbatch -N3 -o /dev/null --wrap true 2>&1 || echo "exit=$?"; } >sbatch_submit_too_many_nodes.txt
{ scancel "$done_ok" 999999 2>&1 || echo "exit=$?"; } >scancel_finished_and_unknown.txt
txt=(./*.txt)
echo "recorded: ${#txt[@]} files"
