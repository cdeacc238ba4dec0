#!/bin/bash
# The image's entrypoint: `spyre-server serve ARGS` (the image's CMD gives the config file), or
# `spyre-server COMMAND ARGS` when the first argument names another command.
#
# On the spyre backend (model.backend, from the config file, environment and flags alike) it
# first sets up the Spyre card as the reference's image does before it starts its server
# (vllm-spyre's docker/Dockerfile.amd64 and docker/simple_vllm_serve.sh, the image of
# sendnn-inference, the reference stack):
#   - the runtime's environment, each variable only where the container does not set it
#     (docker run -e wins, as it does over the reference image's ENV): FLEX_COMPUTE=SENTIENT
#     (the card itself; unset, the stack runs its simulator), FLEX_DEVICE=PF (COMPILE for
#     `compile`, the reference's compile-only setting in platform.py),
#     DISTRIBUTED_STRATEGY_IGNORE_MODULES=WordEmbedding,Embedding and the stack's log levels;
#   - then the Spyre runtime image's /etc/profile.d/ibm-aiu-setup.sh, sourced when present: it
#     configures the cards allocated to the container, at run time.
# The reference's ~/.senlib.json is in the image (docker/.senlib.json). On the cpu backend
# nothing is set or sourced. exec: the server is PID 1 and gets the stop signals itself.
set -e

case "${1:-}" in
    serve | compile | prepare-model | bench)
        command=$1
        shift
        ;;
    *) command=serve ;;
esac

backend=""
if [ "$command" = serve ] || [ "$command" = compile ]; then
    backend=$(python -m spyre_server.entrypoints.configured_backend "$@" 2>/dev/null || true)
fi

if [ "$backend" = spyre ]; then
    device=PF
    [ "$command" = compile ] && device=COMPILE
    export FLEX_COMPUTE="${FLEX_COMPUTE-SENTIENT}"
    export FLEX_DEVICE="${FLEX_DEVICE-$device}"
    export DISTRIBUTED_STRATEGY_IGNORE_MODULES="${DISTRIBUTED_STRATEGY_IGNORE_MODULES-WordEmbedding,Embedding}"
    export DTLOG_LEVEL="${DTLOG_LEVEL-error}"
    export DT_DEEPRT_VERBOSE="${DT_DEEPRT_VERBOSE--1}"
    export TORCH_SENDNN_LOG="${TORCH_SENDNN_LOG-WARNING}"
    export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM-false}"
    if [ -f /etc/profile.d/ibm-aiu-setup.sh ]; then
        # shellcheck disable=SC1091
        source /etc/profile.d/ibm-aiu-setup.sh
    fi
fi

exec spyre-server "$command" "$@"
