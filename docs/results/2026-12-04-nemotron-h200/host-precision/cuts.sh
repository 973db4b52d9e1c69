set -u
cd /work/wt-hprec
for pat in 'M*M' 'M*M-'; do
  n=${#pat}; d=/work/hp/cut-$n; mkdir -p $d
  /work/pyenv/bin/python scripts/gpu/make_checkpoints.py --out $d --models nemotron-h-4l --seed 0 --no-verify --device cpu \
    --override "hybrid_override_pattern=\"$pat\"" --override num_hidden_layers=$n > $d/make.log 2>&1
  /work/pyenv/bin/python scripts/gpu/reference_logits.py --model "$d/nemotron-h-4l+smoke" --out $d/ref.safetensors \
    --prompt-tokens 128 --decode-steps 4 --seed 0 --dtype float32 --also-bf16 --device cpu > $d/ref.log 2>&1
  echo "cut $pat done $(date)"
done
