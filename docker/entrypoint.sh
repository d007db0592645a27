#!/usr/bin/env bash
# Container entrypoint: find the checkpoint (or build the tiny demo one when none is mounted),
# render the model repository from the environment (docker/render_config.py: the gliner2
# CPU front, its GPU stage gliner2_core and manylora_control), then exec tritonserver: it
# gets the container's signals, and its exit code is the container's. tritonserver loads
# every model of the rendered repository, and /v2/health/ready answers 200 only once all of
# them are ready (--strict-readiness): the front and its GPU stage.
#
#   MANYLORA_CHECKPOINT    GLiNER2 checkpoint folder (default /models/checkpoint): the
#                          weights of gliner2_core, the tokenizer of gliner2
#   MANYLORA_ADAPTER_DIR   folder of PEFT adapter folders, read by gliner2_core (default
#                          /models/adapters; set it empty to serve the base model only)
#   MANYLORA_DEMO          if-missing (default): no config.json in MANYLORA_CHECKPOINT builds
#                          the tiny demo checkpoint in MANYLORA_RUN_DIR, and the demo adapters
#                          when the adapter folder is empty (random weights, meaningless
#                          answers; about a minute), and serves them; never: a missing
#                          checkpoint stops the container (production)
#   MANYLORA_PARAM_<KEY>, MANYLORA_GPUS, MANYLORA_INSTANCES_PER_GPU (gliner2_core),
#   MANYLORA_FRONT_INSTANCES (gliner2): see render_config.py
#   MANYLORA_RUN_DIR       writable folder for the rendered repository and the demo
#                          (default /tmp/manylora)
#
# Arguments are passed to tritonserver (e.g. --log-verbose=1). A first argument that is not
# an option is run instead of the server: `docker run -it IMAGE bash`.
set -euo pipefail

app=$(cd "$(dirname "$0")/.." && pwd) # /opt/manylora in the image
checkpoint=${MANYLORA_CHECKPOINT:-/models/checkpoint}
adapters=${MANYLORA_ADAPTER_DIR-/models/adapters}
demo=${MANYLORA_DEMO:-if-missing}
run_dir=${MANYLORA_RUN_DIR:-/tmp/manylora}

if [[ $# -gt 0 && $1 != -* ]]; then
  exec "$@"
fi

case $demo in if-missing | never) ;; *)
  echo "entrypoint: MANYLORA_DEMO must be if-missing or never, got '$demo'" >&2
  exit 2
  ;;
esac

if [[ ! -f $checkpoint/config.json ]]; then
  if [[ $demo == never ]]; then
    echo "entrypoint: no GLiNER2 checkpoint at $checkpoint (no config.json) and MANYLORA_DEMO=never;" \
      "mount one there or set MANYLORA_CHECKPOINT" >&2
    exit 1
  fi
  echo "entrypoint: no checkpoint at $checkpoint: serving the trained tiny demo checkpoint (built on first start: a few minutes)"
  checkpoint=$run_dir/models/demo-tiny
  [[ -f $checkpoint/config.json ]] || python3 -m manylora.demo --size tiny --train --out "$checkpoint"
  # Adapters are made for one checkpoint's shapes: the demo adapters go with the demo
  # checkpoint, and only into an empty or missing adapter folder; into that folder itself
  # when it is writable (compose's load test reads the adapter names from there; the demo
  # build is deterministic, so they fit a later container's demo checkpoint too).
  if [[ -n $adapters && -z "$(ls -A "$adapters" 2>/dev/null)" ]]; then
    [[ -d $adapters && -w $adapters ]] || adapters=$run_dir/models/demo-tiny-adapters
    python3 -m manylora.lora.demo_adapters --checkpoint "$checkpoint" --out "$adapters"
  fi
fi

export MANYLORA_CHECKPOINT=$checkpoint MANYLORA_ADAPTER_DIR=$adapters
echo "entrypoint: model repository $run_dir/model_repository, the rendered configs:"
python3 "$app/docker/render_config.py" --source "$app/model_repository" --out "$run_dir/model_repository"

# NVIDIA's own entrypoint prints the image's banner and checks the driver and --shm-size.
launcher=()
if [[ -x /opt/nvidia/nvidia_entrypoint.sh ]]; then launcher=(/opt/nvidia/nvidia_entrypoint.sh); fi
exec ${launcher[@]+"${launcher[@]}"} tritonserver \
  --model-repository="$run_dir/model_repository" \
  --disable-auto-complete-config \
  --strict-readiness=true \
  --exit-timeout-secs="${MANYLORA_EXIT_TIMEOUT_SECS:-30}" \
  "$@"
