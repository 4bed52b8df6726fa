#!/bin/bash
# GPU sweep: each argument "NAME|GPU|extra options" is one variant; packs logs and the best checkpoint into $OUT.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAYON_NUM_THREADS=1
B=${BUDGET:-470}
W=${WORKERS:-7}
common="--preset docqa --time-budget-s $B --steps 60000 --num-workers $W --log-every 250 --eval-every 500 --final-eval-examples 2000 --answer-weight 5 --overwrite"
nvidia-smi -L
names=""
for v in "$@"; do
  IFS='|' read -r name gpu extra <<< "$v"
  names="$names $name"
  CUDA_VISIBLE_DEVICES=$gpu python3 -m cluster.ops.cli make-model /tmp/run$name $common $extra > /tmp/run$name.log 2>&1 &
done
wait
mkdir -p /tmp/logs
for r in $names; do cp /tmp/run$r.log /tmp/logs/; cp /tmp/run$r/training.json /tmp/logs/training$r.json 2>/dev/null; done
tar czf $OUT/logs.tgz -C /tmp logs
NAMES="$names" python3 - <<'PY'
import json, os, subprocess
best = None
for r in os.environ["NAMES"].split():
    try:
        h = json.load(open(f"/tmp/run{r}/training.json"))["heldout"]
    except Exception as e:
        print(r, "failed", e); continue
    score = h["8docs"]["1hop"] + h["8docs"]["2hop"]
    print(r, {k: (v["1hop"], v["2hop"]) for k, v in h.items()}, "score", score)
    if best is None or score > best[0]:
        best = (score, r)
print("best", best)
if best:
    subprocess.run(["tar", "cf", os.environ["OUT"] + f"/best_{best[1]}.tar", "-C", f"/tmp/run{best[1]}", "."], check=True)
PY
for r in $names; do echo "== $r"; grep -E "timing|gate |held-out 8|final|budget|restoring|Error|error" /tmp/run$r.log | tail -45; done
