# Sourced by kvscope's scripts: where the cache, the Python environment and the models live, and the
# variables that keep Hugging Face libraries offline with their caches under ours.
#   KVSCOPE_CACHE   the cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvscope)
#   KVSCOPE_VENV    the Python environment for requirements.lock ($KVSCOPE_CACHE/venv-<hash>)
#   KVSCOPE_MODELS  imported models ($KVSCOPE_CACHE/models)
kvscope_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KVSCOPE_CACHE=${KVSCOPE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvscope}
kvscope_lock_hash=$(sha256sum "$kvscope_root/requirements.lock" | cut -c1-12)
KVSCOPE_VENV=$KVSCOPE_CACHE/venv-$kvscope_lock_hash
KVSCOPE_MODELS=$KVSCOPE_CACHE/models
export KVSCOPE_CACHE KVSCOPE_VENV KVSCOPE_MODELS
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export HF_HOME=$KVSCOPE_CACHE/hf
