set -u
mkdir -p /root/stash && tar xzf .cache/carry/ab.tgz -C /root/stash
G=METRALE_GRID_CAP_LABELS
SPEED_MODELS="qwen3-8b qwen3-0.6b" timeout 200 bash scripts/gpu/speed.sh checkpoints > $OUT/ckpt.log 2>&1; tail -2 $OUT/ckpt.log
rm -rf /root/results-ab; mkdir -p /root/results-ab
RES=/root/results-ab AB="met met_p:$G=qkv=264 met:$G=qkv=264" AB_KERNEL=gemv AB_SHAPE=qwen3-0.6b AB_ROWS=lm_head AB_MODEL_RUNS="8b-short" AB_PARITY=0 AB_REPEAT=2 timeout 400 bash scripts/gpu/speed.sh ab > $OUT/ab.log 2>&1
echo "ab exit $?"; tar czf $OUT/ab-raw.tgz -C /root/results-ab .
rm -rf /root/results-speed; mkdir -p /root/results-speed
SPEED_MODELS=qwen3-8b TL_VARIANTS="base gq264:$G=qkv=264 norm:METRALE_GEMV_NORM=all stall:METRALE_GEMV_STAGE=all" timeout 110 bash scripts/gpu/speed.sh timelines > $OUT/tl8.log 2>&1
echo "tl exit $?"; tar czf $OUT/tl-raw.tgz -C /root/results-speed .
tail -45 $OUT/ab.log; cat $OUT/tl8.log | head -20
