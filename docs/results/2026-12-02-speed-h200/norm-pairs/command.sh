set -u
mkdir -p /root/stash /root/s_n /root/s_q && tar xzf .cache/carry/ab.tgz -C /root/stash && cp /root/stash/met_tn /root/s_n/met_t && cp /root/stash/met_tq /root/s_q/met_t
SPEED_MODELS=qwen3-0.6b timeout 120 bash scripts/gpu/speed.sh checkpoints > $OUT/ckpt.log 2>&1; tail -1 $OUT/ckpt.log
rm -rf /root/results-ab; mkdir -p /root/results-ab
RES=/root/results-ab AB="met_n met_q" AB_KERNEL=gemv AB_SHAPE=qwen3-0.6b AB_ROWS="add.rmsnorm.(qkv|gate)|lm_head m=1" AB_MODEL_RUNS="0.6b" AB_GENERATE=qwen3-0.6b AB_PARITY=0 AB_REPEAT=2 timeout 200 bash scripts/gpu/speed.sh ab > $OUT/ab.log 2>&1
echo "ab exit $?"; tar czf $OUT/ab-raw.tgz -C /root/results-ab .
rm -rf /root/results-speed; mkdir -p /root/results-speed
C=METRALE_CARVEOUT_LABELS
STASH=/root/s_n SPEED_MODELS=qwen3-0.6b TL_VARIANTS="n" timeout 30 bash scripts/gpu/speed.sh timelines > /root/tl-n.txt 2>&1
STASH=/root/s_q SPEED_MODELS=qwen3-0.6b TL_VARIANTS="q qgu:$C=qkv=100+o=100+gate_up=100" timeout 45 bash scripts/gpu/speed.sh timelines > /root/tl-q.txt 2>&1
cp /root/tl-n.txt /root/tl-q.txt /root/results-speed/; tar czf $OUT/tl-raw.tgz -C /root/results-speed .
tail -22 $OUT/ab.log; head -14 /root/tl-n.txt; head -14 /root/tl-q.txt
