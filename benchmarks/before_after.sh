#!/bin/bash
# Before and after a change, side by side: run COMMAND from two checkouts of pslink, alternating
# (BEFORE first), ROUNDS times each, and print each run's last line; every run's output is kept
# in /tmp/before_after/NAME/{before,after}-N.log.
#
#   benchmarks/before_after.sh BEFORE_TREE AFTER_TREE NAME ROUNDS -- COMMAND...
#   benchmarks/before_after.sh /work/base /work/main lat 3 -- -m pslink.cli launch -n 2 python benchmarks/hvd_latency.py
#
# COMMAND runs with the tree's python path first (PYTHONPATH=TREE), from that tree, with this
# python (a venv that has the tree's dependencies).
set -u
before=$1; after=$2; name=$3; rounds=$4; shift 5
python=${PYTHON:-python}
mkdir -p /tmp/before_after/$name
for i in $(seq 1 "$rounds"); do
  for variant in before after; do
    tree=$before; [ $variant = after ] && tree=$after
    (cd "$tree" && PYTHONPATH=$tree timeout 1800 "$python" "$@" > /tmp/before_after/$name/$variant-$i.log 2>&1)
    echo "$name $variant $i rc=$? $(tail -1 /tmp/before_after/$name/$variant-$i.log | cut -c1-300)"
  done
done
