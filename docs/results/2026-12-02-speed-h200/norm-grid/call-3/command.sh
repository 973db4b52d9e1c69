set -u
mkdir -p /root/stash /root/stash2 && tar xzf .cache/carry/ab.tgz -C /root/stash && cp /root/stash/met_tn /root/stash2/met_t
SPEED_MODELS="qwen3-8b qwen3-0.6b" timeout 200 bash scripts/gpu/speed.sh checkpoints > $OUT/ckpt.log 2>&1; tail -1 $OUT/ckpt.log
rm -rf /root/results-ab; mkdir -p /root/results-ab
RES=/root/results-ab AB="met met_n" AB_KERNEL=gemv AB_SHAPE=qwen3-0.6b AB_ROWS=lm_head AB_MODEL_RUNS="0.6b" AB_PARITY=0 AB_REPEAT=2 timeout 300 bash scripts/gpu/speed.sh ab > $OUT/ab.log 2>&1
echo "ab exit $?"; tar czf $OUT/ab-raw.tgz -C /root/results-ab .
rm -rf /root/results-speed; mkdir -p /root/results-speed
SPEED_MODELS=qwen3-0.6b TL_VARIANTS="main" timeout 40 bash scripts/gpu/speed.sh timelines > $OUT/tl-main.log 2>&1
STASH=/root/stash2 SPEED_MODELS=qwen3-0.6b TL_VARIANTS="new" timeout 40 bash scripts/gpu/speed.sh timelines > $OUT/tl-new.log 2>&1
echo "tl exit $?"; tar czf $OUT/tl-raw.tgz -C /root/results-speed .
tail -32 $OUT/ab.log; head -16 $OUT/tl-main.log; head -16 $OUT/tl-new.log
