#!/usr/bin/env bash
# The GPU smoke test: the one script to run the day a GPU is available.
#
#   bench/gpu_smoke.sh [OUT_DIR]          # default OUT_DIR: /tmp/fluxrl-gpu-smoke
#
# On whatever GPUs are visible it runs, one after the other, real `python -m workers run`
# specs (bench/gpu_specs/) and the trainer bench (bench/gpu_trainer.py), then prints one
# table: each check, what it ran, its status, seconds and the peak GPU memory seen while it
# ran (nvidia-smi, sampled every second, the most on any one GPU). A check that needs more
# GPUs than are visible says how many (nothing is skipped silently). Exit code: 0 when every check that could run passed,
# 1 when one failed, 2 at once when no GPU is visible.
#
# Environment: PYTHON (default .venv/bin/python), SMOKE_KEEP=1 keeps OUT_DIR's run folders,
# SMOKE_ONLY="colocated shared-async ..." runs only the checks named (a borrowed GPU's time is short;
# the others' rows say "not selected").
set -u -o pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-/tmp/fluxrl-gpu-smoke}

# -- a GPU, or a loud stop --------------------------------------------------------------
smi_gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    smi_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
torch_gpus="not asked"  # importing torch takes seconds: only when nvidia-smi sees a GPU
if [ "${smi_gpus:-0}" -gt 0 ]; then
    torch_gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
fi
if [ "${smi_gpus:-0}" -eq 0 ] || [ "$torch_gpus" = 0 ]; then
    echo "gpu_smoke: FAILED: no CUDA GPU visible: nvidia-smi/torch.cuda.device_count() = 0" >&2
    echo "  (nvidia-smi -L lists ${smi_gpus:-0} GPU(s)$(command -v nvidia-smi >/dev/null || echo ': no nvidia-smi');" \
         "torch.cuda.device_count() = $torch_gpus with $PY; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})" >&2
    exit 2
fi
GPUS=$torch_gpus
mkdir -p "$OUT"
export SMOKE_OUT="$OUT"
echo "gpu_smoke: $GPUS GPU(s): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c | xargs)"
echo "gpu_smoke: logs and run folders under $OUT"

ROWS=()  # "check|what|status|seconds|peak MiB"
FAILED=0

sample_memory() {  # appends the most memory used on any one GPU now to $1
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1 >>"$1"
}

peak_sampler() {  # samples each second into $1
    while :; do
        sample_memory "$1"
        sleep 1
    done
}

# check NAME NEED_GPUS WHAT COMMAND...: runs COMMAND (its output to $OUT/NAME.log), times it,
# samples GPU memory meanwhile and adds a row.
check() {
    local name=$1 need=$2 what=$3
    shift 3
    if [ -n "${SMOKE_ONLY:-}" ] && [[ " $SMOKE_ONLY " != *" $name "* ]]; then
        ROWS+=("$name|$what|not selected (SMOKE_ONLY)|-|-")
        return
    fi
    if [ "$GPUS" -lt "$need" ]; then
        ROWS+=("$name|$what|needs $need GPUs ($GPUS visible)|-|-")
        return
    fi
    local log="$OUT/$name.log" mem="$OUT/$name.mem" start end rc peak
    : >"$mem"
    echo "gpu_smoke: [$name] $what ..."
    export SMOKE_CHECK=$name  # a run's record: $OUT/$name.record.json (run_spec)
    sample_memory "$mem"  # one sample at least, however short the check (the sampler may not get to one)
    peak_sampler "$mem" &
    local sampler=$!
    start=$(date +%s.%N)
    "$@" >"$log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    kill "$sampler" 2>/dev/null
    wait "$sampler" 2>/dev/null
    peak=$(sort -n "$mem" | tail -1)
    local seconds
    seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
    if [ -f "$OUT/$name.record.json" ]; then  # the peak GPU memory seen beside the planner's figure
        "$PY" -c 'import json, sys; p = sys.argv[1]; r = json.load(open(p)); r["status"] = "ok" if sys.argv[3] == "0" else "failed"
r["peak_gpu_mib"] = int(sys.argv[2]) if sys.argv[2].isdigit() else None
r["peak_over_plan"] = round(r["peak_gpu_mib"] / 1024 / r["planned_gpu_gib"], 3) if r["peak_gpu_mib"] and r.get("planned_gpu_gib") else None
json.dump(r, open(p, "w"), indent=1)' "$OUT/$name.record.json" "${peak:-}" "$rc"
    fi
    if [ "$rc" -eq 0 ]; then
        ROWS+=("$name|$what|ok|$seconds|${peak:-?}")
    else
        ROWS+=("$name|$what|FAILED (exit $rc, $log)|$seconds|${peak:-?}")
        FAILED=1
        echo "gpu_smoke: [$name] FAILED (exit $rc); the end of $log:" >&2
        tail -20 "$log" >&2
    fi
}

# check_engine: a check whose runs start vLLM engines; without vLLM (a GPU box with PyTorch and
# DeepSpeed only) its row says so, and the trainer checks still run.
HAVE_VLLM=1
"$PY" -c 'import vllm' >/dev/null 2>&1 || HAVE_VLLM=0
check_engine() {
    if [ "$HAVE_VLLM" = 0 ] && [ "$GPUS" -ge "$2" ]; then
        ROWS+=("$1|$3|needs vLLM (not importable with $PY)|-|-")
        return
    fi
    check "$@"
}

# run SPEC: `python -m workers run` on a rendered copy of bench/gpu_specs/SPEC.yaml (${VARS}
# expanded), then checks its result.json: every step trained, finite numbers.
run_spec() {
    local spec=$1 rendered="$OUT/$1.yaml" out="$OUT/run-$1"
    rm -rf "$out"
    "$PY" -c 'import os, sys; open(sys.argv[2], "w").write(os.path.expandvars(open(sys.argv[1]).read()))' \
        "bench/gpu_specs/$spec.yaml" "$rendered" || return 1
    "$PY" -m workers run "$rendered" --out "$out" --no-progress || return $?
    "$PY" - "$rendered" "$out/result.json" <<'EOF'
import json, math, sys
from workers.spec import load_spec_file
spec, result = load_spec_file(sys.argv[1]), json.load(open(sys.argv[2]))
print("result:", json.dumps(result))
assert result["steps"] >= 1, f"no step trained: {result}"
assert all(math.isfinite(v) for v in result.values() if isinstance(v, float)), result
steps = [json.loads(line) for line in open(sys.argv[2].replace("result.json", "metrics.jsonl"))]
if spec.resources.colocate and spec.schedule.mode == "sync":  # asleep through every trainer step, awake for the update
    slept = [m for m in steps if "engine/sleep_s" in m]
    assert slept and len(slept) == result["steps"], f"{len(slept)} steps with engine/sleep_s of {result['steps']}"
    print("sleep_s max %.2f, wake_s max %.2f" % (max(m["engine/sleep_s"] for m in slept),
                                                  max(m["engine/wake_s"] for m in slept)))
if result["steps"] < spec.stop.max_steps:
    print(f"note: {result['steps']} of {spec.stop.max_steps} steps before stop.max_minutes")
# the record for bench/results/gpu_<device>.json: throughput per GPU, the planner's GPU memory, accuracy
import os
from workers.cluster.placement import detect_machine, model_size, plan_placement
from workers.models.preflight import resolve_model_path
plan = plan_placement(spec, detect_machine(), model_size(resolve_model_path(spec.model.path), spec.model.lora))
gpus = len({(p.node, g) for p in plan.processes for g in p.gpus}) or 1
gen = [m["rollout/gen_tokens_per_s"] for m in steps if m.get("rollout/gen_tokens_per_s")]
record = {"check": os.environ.get("SMOKE_CHECK"), "spec": spec.name, "gpus": gpus, "mode": spec.schedule.mode,
          "colocate": spec.resources.colocate, "engines_sleep": plan.sleeps, "model_dtype": spec.model.dtype,
          "zero_stage": spec.trainer.zero_stage, "steps": result["steps"], "seconds": round(result["seconds"], 1),
          "trained_tokens_per_s_per_gpu": round(result["trained_tokens"] / result["seconds"] / gpus, 1),
          "gen_tokens_per_s_per_engine": round(sum(gen) / len(gen), 1) if gen else None,
          "accuracy_before": result.get("accuracy_before"), "accuracy_after": result.get("accuracy_after"),
          "planned_gpu_gib": round(max(g.total_gib for g in plan.memory.gpus), 2) if plan.memory else None}
json.dump(record, open(os.path.join(os.environ["SMOKE_OUT"], f"{record['check']}.record.json"), "w"), indent=1)
print("record:", json.dumps(record))
EOF
}


build_05b() {  # the 0.5B-class model and a chat dataset for it, built locally (no download)
    "$PY" -m workers build-model qwen2 --out "$OUT/zoo-qwen2" --steps 1 --dataset "$OUT/zoo-qwen2.jsonl" --rows 2000 \
        || return $?
    "$PY" bench/gpu_trainer.py --write-05b "$OUT/qwen2-05b" --like "$OUT/zoo-qwen2"
}

# -- the checks ------------------------------------------------------------------------
check trainer-bf16 1 "bench/gpu_trainer.py: DeepSpeed ranks (1/GPU), ZeRO 0-3 bf16 (fp32 grad accumulation), KL reference, weight export (NCCL with 2+ GPUs)" \
    "$PY" bench/gpu_trainer.py --stages 0 1 2 3 --dtype bfloat16 --steps 3
check trainer-fp16 1 "bench/gpu_trainer.py: fp16, ZeRO 0 (autocast + GradScaler) and 2 (dynamic loss scaling)" \
    "$PY" bench/gpu_trainer.py --stages 0 2 --dtype float16 --steps 3
check kl-start 1 "bench/gpu_kl_start.py: the policy's forward with gradients and the frozen KL reference's without give identical log-probs (the KL starts at 0)" \
    "$PY" bench/gpu_kl_start.py
check stages-gpu 1 "bench/gpu_stages.py: the reward model, KL reference and critic-copy scorers on cuda against the CPU (fp32 1e-4; bf16 autocast 0.1), micro-batches split by tokens" \
    "$PY" bench/gpu_stages.py
check_engine disaggregated 2 "workers run gpu_specs/disaggregated.yaml: trainer GPU 0, engine GPU 1, async, CUDA graphs" \
    run_spec disaggregated
check_engine colocated 1 "workers run gpu_specs/colocated.yaml: engine and trainer on one GPU, sync, the engine asleep (vLLM sleep level 1) through every trainer step" \
    run_spec colocated
check_engine shared-async 1 "workers run gpu_specs/shared_async.yaml: engine and trainer sharing one GPU by memory (0.5), async, in-flight updates, the engine never asleep" \
    run_spec shared_async
check_engine stages-one-gpu 1 "workers run gpu_specs/stages_one_gpu.yaml: GAE with a reward model, KL reference and critic-copy workers and the engine (colocated, sync) on ONE GPU" \
    run_spec stages_one_gpu
check_engine tp2 3 "workers run gpu_specs/tp2.yaml: one engine over 2 GPUs (tensor_parallel 2, vLLM's mp executor)" \
    run_spec tp2
check_engine collective 2 "workers run gpu_specs/collective.yaml: weights over NCCL to an engine server process" \
    run_spec collective
check_engine stages 2 "workers run gpu_specs/stages.yaml: reward model, KL reference and critic-copy workers on trainer GPU 0 (inference_gpu: trainer), GAE, engine GPU 1" \
    run_spec stages
check_engine zero3 3 "workers run gpu_specs/zero3.yaml: 2 trainer ranks ZeRO-3 + KL, engine on a third GPU" \
    run_spec zero3
check build-05b 1 "build a 0.5B-class Qwen2 locally (build-model qwen2 + Qwen2.5-0.5B's body: 0.36 B parameters with its 2048-token vocabulary)" build_05b
if [ -d "$OUT/qwen2-05b" ]; then
    export SMOKE_MODEL_05B="$OUT/qwen2-05b" SMOKE_DATASET="$OUT/zoo-qwen2.jsonl"
    check trainer-05b 1 "bench/gpu_trainer.py on the 0.5B-class model: ZeRO 0, 2 and 3 bf16, the planner's memory against the peak" \
        "$PY" bench/gpu_trainer.py --model "$OUT/qwen2-05b" --stages 0 2 3 --dtype bfloat16 --steps 2
    check_engine model-05b 2 "workers run gpu_specs/model_05b.yaml: the 0.5B-class model, ZeRO-2 bf16, engine GPU 1" \
        run_spec model_05b
    check_engine model-05b-one-gpu 1 "workers run gpu_specs/model_05b_one_gpu.yaml: the 0.5B-class model, ZeRO-2 bf16, the engine in 0.4 of the same GPU, async" \
        run_spec model_05b_one_gpu
else
    ROWS+=("trainer-05b|bench/gpu_trainer.py on the 0.5B-class model|not run: build-05b failed|-|-")
    ROWS+=("model-05b|workers run gpu_specs/model_05b.yaml|not run: build-05b failed|-|-")
    ROWS+=("model-05b-one-gpu|workers run gpu_specs/model_05b_one_gpu.yaml|not run: build-05b failed|-|-")
fi

# -- one table -------------------------------------------------------------------------
echo
printf '%-14s | %-9s | %7s | %13s | %s\n' check status seconds "peak GPU MiB" "what ran"
printf '%s\n' "---------------+-----------+---------+---------------+---------"
for row in "${ROWS[@]}"; do
    IFS='|' read -r name what status seconds peak <<<"$row"
    short=$status
    case $status in ok) ;; FAILED*) short=FAILED ;; *) short="not run" ;; esac
    printf '%-14s | %-9s | %7s | %13s | %s\n' "$name" "$short" "$seconds" "$peak" "$what"
    [ "$short" = ok ] || echo "               ↳ $status"
done
# every run's record in one file: bench/results/gpu_<device>.json (and $OUT/gpu_results.json)
"$PY" bench/gpu_records.py "$OUT" "${ROWS[@]}"
[ "${SMOKE_KEEP:-0}" = 1 ] || [ "$FAILED" -ne 0 ] || rm -rf "$OUT"/run-* "$OUT"/qwen2-05b
if [ "$FAILED" -ne 0 ]; then
    echo "gpu_smoke: FAILED (logs in $OUT)" >&2
    exit 1
fi
echo "gpu_smoke: every check that could run passed"
